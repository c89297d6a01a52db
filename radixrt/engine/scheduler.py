"""Cache-aware continuous batching over the paged pool and the radix cache.

Each step runs one forward over a ragged batch: one token for every decoding request, a chunk
for every request still prefilling, and chunks of newly admitted requests under the step's
token budget. Requests join and leave at every step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from radixrt.config import ServerArgs
from radixrt.structured.bitmask import allocate_bitmask, apply_bitmask
from radixrt.structured.compiler import ConstraintCompiler
from radixrt.engine.detokenizer import IncrementalDetokenizer
from radixrt.executor.forward_batch import ForwardBatch
from radixrt.executor.model_runner import ModelRunner
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.protocol import ErrorCode, RequestError
from radixrt.engine.request import FinishReason, Req
from radixrt.engine.sampler import sample
from radixrt.sampling_params import SamplingParams
from radixrt.engine.schedule_policy import match_key, order_waiting

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7  # share of a running request's max_new_tokens reserved for it
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per step, while nothing is retracted
IN_BATCH_SHARE_TOKENS = 16  # defer a request sharing this many new tokens with one admitted this step


class Scheduler:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.runner = ModelRunner(args)
        self.tokenizer = self.runner.tokenizer
        self.allocator = self.runner.allocator
        self.req_to_token = self.runner.req_to_token_pool.req_to_token
        self.page_size = args.page_size
        self.tree = RadixCache(args.page_size, self.allocator.free, disable=args.disable_radix_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._seeds = torch.Generator().manual_seed(args.random_seed)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.num_preemptions = 0
        self.generated_tokens = 0
        self.aborted_requests = 0  # by their clients (an abort op or a client gone silent)
        self.peak_used_tokens = 0
        self.step_time = 0.0  # seconds in forward + sampling
        self.mask_time = 0.0  # of which, building and applying constraint masks
        self._decode_steps = 0
        self._log_mark = (time.monotonic(), 0)
        self._ended: list[Req] = []  # finished outside a forward (aborts), reported by step()
        self.pins: dict[str, object] = {}  # pin id -> tree node locked on a client's behalf
        self.compiler: ConstraintCompiler | None = None
        self.stalled = False

    # ---- requests in and out ---------------------------------------------------------------
    def make_request(self, rid: str, input_ids: list[int], params: SamplingParams, sample_index: int = 0) -> Req:
        if not input_ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.runner.vocab_size
               for t in input_ids):
            raise ValueError(f"token ids must be ints in [0, {self.runner.vocab_size})")
        limit = min(self.runner.context_length, self.allocator.total_tokens)
        if len(input_ids) >= limit:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, f"the prompt has {len(input_ids)} tokens; this server takes at most {limit - 1} "
                             f"(context length {self.runner.context_length}, pool {self.allocator.total_tokens})")
        seed = params.seed + sample_index if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        req = Req(rid, list(input_ids), params,
                  IncrementalDetokenizer(self.tokenizer, input_ids, params.skip_special_tokens),
                  torch.Generator().manual_seed(seed))
        constraint = params.constraint()
        if constraint is not None:  # compiled off this thread; admission waits for it
            req.constraint = self._compiler().compile_async(**{constraint[0]: constraint[1]})
        return req

    def _compiler(self) -> ConstraintCompiler:
        if self.compiler is None:
            self.compiler = ConstraintCompiler(self.tokenizer, self.runner.vocab_size)
        return self.compiler

    def _constraint_ready(self, req: Req) -> bool:
        """False while the request's constraint compiles; a failed compile ends the request."""
        if req.constraint is None or req.guide is not None:
            return True
        if not req.constraint.done():
            return False
        try:
            jump = self.args.enable_jump_forward and not req.params.return_logprob  # forced tokens get no logprobs
            req.guide = self.compiler.guide(req.constraint.result(), jump_forward=jump)
            return True
        except ValueError as e:
            req.finish_reason = FinishReason.abort(str(e), ErrorCode.INVALID_CONSTRAINT)
            self._finish(req)
            return False

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> list[Req]:
        """Abort every waiting or running request whose id is `rid` or starts with `rid-` (samples)."""
        def hit(r: Req) -> bool:
            return r.rid == rid or r.rid.startswith(rid + "-")
        aborted = [r for r in self.waiting + self.running if hit(r)]
        self.aborted_requests += len(aborted)
        for req in aborted:
            req.finish_reason = FinishReason.abort("aborted by the client")
            self._finish(req)
        return aborted

    def pin(self, pin_id: str, input_ids: list[int]) -> int:
        """Lock the cached prefix of `input_ids` so eviction cannot take it (fork's shared prefix).
        Returns how many tokens are pinned (what the cache held)."""
        if pin_id in self.pins:
            raise ValueError(f"pin {pin_id!r} exists")
        slots, node = self.tree.match_prefix(list(input_ids))
        self.tree.inc_lock_ref(node)
        self.pins[pin_id] = node
        return len(slots)

    def unpin(self, pin_id: str) -> bool:
        node = self.pins.pop(pin_id, None)
        if node is not None:
            self.tree.dec_lock_ref(node)
        return node is not None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests that got a new token or finished."""
        self._ended: list[Req] = []
        plan = self._schedule()
        self.stalled = not plan  # e.g. every waiting request's constraint is still compiling
        start = time.perf_counter()
        updated = self._process(plan, self.runner.forward(self._build_batch(plan))) if plan else []
        self.step_time += time.perf_counter() - start
        return updated + [r for r in self._ended if r not in updated]

    def _schedule(self) -> list[tuple[Req, int]]:
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        chunk = self.args.chunked_prefill_size
        # with chunking on, a step's prompt tokens are bounded too, so decodes never wait on a long prefill
        budget = min(self.args.max_prefill_tokens, chunk) if chunk > 0 else self.args.max_prefill_tokens
        plan = []
        for req in self.running:
            n = self._chunk(req.tokens_to_compute, budget) if req.tokens_to_compute > 1 else 1
            if n:
                plan.append((req, n))
                budget -= n if n > 1 else 0
        retractions = self.num_preemptions
        plan = self._allocate_running(plan)
        if self.args.schedule_mode == "static":
            if not self.running:  # the whole next batch boards at once, its prompts chunked as usual
                plan += self._admit(budget=1 << 62, busy=False, defer_shared=False)
        elif self.num_preemptions == retractions:  # memory is tight right after a retraction
            plan += self._admit(budget, bool(plan))
        return plan

    def _chunk(self, need: int, budget: int) -> int:
        chunk = self.args.chunked_prefill_size
        return min(need, chunk, budget) if chunk > 0 else (need if need <= budget else 0)

    def _slots_needed(self, req: Req, n: int) -> int:
        """Slots a request must take from the allocator for n more tokens (whole pages)."""
        p = self.page_size
        room = min((-req.kv_len) % p, n)  # the request's own partly filled last page
        return -(-(n - room) // p) * p

    def _allocate_running(self, plan: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """Give every running request slots for its step, evicting then retracting if short."""
        need = sum(self._slots_needed(r, n) for r, n in plan)
        while need > self.allocator.available() + self.tree.evictable_size:
            victim = self._pick_victim([r for r, _ in plan])
            if victim is None:
                break
            plan = [(r, n) for r, n in plan if r is not victim]
            need = sum(self._slots_needed(r, n) for r, n in plan)
        kept = []
        for req, n in plan:
            if self._alloc_slots(req, n):
                kept.append((req, n))
            else:  # a lone request larger than the whole pool
                req.finish_reason = FinishReason.abort("the KV pool cannot hold this request")
                self._finish(req)
        return kept

    def _pick_victim(self, candidates: list[Req]) -> Req | None:
        """Retract the request that loses least: fewest generated tokens, then longest prompt."""
        if len(candidates) <= 1:
            return None
        victim = min(candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        self._retract(victim)
        return victim

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.kv_len = req.tree_len = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.waiting.insert(0, req)
        logger.info("retracted request %s after %d tokens (pool full); it will be recomputed",
                    req.rid, len(req.output_ids))

    def _alloc_slots(self, req: Req, n: int) -> bool:
        short = self._slots_needed(req, n) - self.allocator.available()
        if short > 0:
            self.tree.evict(short)
        row = self.req_to_token[req.row]
        last = int(row[req.kv_len - 1]) if req.kv_len else 0
        slots = self.allocator.alloc_extend(last, req.kv_len, n)
        if slots is None:
            return False
        row[req.kv_len: req.kv_len + n] = slots.to(torch.int32)
        self.peak_used_tokens = max(self.peak_used_tokens, self.allocator.total_tokens - self.allocator.available())
        return True

    def _reserved_tokens(self) -> float:
        return sum(r.tokens_to_compute - 1 + r.remaining_new_tokens() * self.new_token_ratio for r in self.running)

    def _admit(self, budget: int, busy: bool, defer_shared: bool = True) -> list[tuple[Req, int]]:
        admitted: list[tuple[Req, int]] = []
        if not self.waiting:
            return admitted
        reserved = self._reserved_tokens()
        shared_keys: set[tuple[int, ...]] = set()
        for req in order_waiting(self.args.schedule_policy, self.waiting, self.tree):
            if len(self.running) >= self.args.max_running_requests or budget <= 0:
                break
            if not self._constraint_ready(req):
                continue
            if self.runner.req_to_token_pool.available() == 0:
                break
            slots, node = self.tree.match_prefix(match_key(req))
            m = len(slots)
            extend = len(req.all_ids) - m
            if defer_shared and not self.tree.disable and extend - 1 >= IN_BATCH_SHARE_TOKENS:
                key = tuple(req.all_ids[m: m + IN_BATCH_SHARE_TOKENS])
                if key in shared_keys:
                    continue  # prefilled next step, on top of what this step caches
                shared_keys.add(key)
            n = self._chunk(extend, budget)
            if n == 0:
                if busy or admitted:
                    break
                n = extend  # an unchunked prompt over the budget runs alone
            self.tree.inc_lock_ref(node)
            future = extend - n + req.remaining_new_tokens() * self.new_token_ratio
            room = self.allocator.available() + self.tree.evictable_size - reserved
            if (self.running or admitted) and room < n + future:
                self.tree.dec_lock_ref(node)
                break
            req.row = self.runner.req_to_token_pool.alloc()
            self.req_to_token[req.row, :m] = slots.to(torch.int32)
            req.kv_len = req.tree_len = m
            req.last_node = node
            if not self._alloc_slots(req, n):
                self._release(req)
                break
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = min(m, len(req.input_ids))
                self.prompt_tokens_total += len(req.input_ids)
                self.cached_tokens_total += req.cached_tokens
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append((req, n))
            budget -= n
            reserved += future
        if admitted:
            self._log_prefill(admitted)
        return admitted

    def _build_batch(self, plan: list[tuple[Req, int]]) -> ForwardBatch:
        ids, positions, slots = [], [], []
        for req, n in plan:
            ids.extend(req.all_ids[req.kv_len: req.kv_len + n])
            positions.extend(range(req.kv_len, req.kv_len + n))
            slots.append(self.req_to_token[req.row, req.kv_len: req.kv_len + n])
        device = self.runner.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            out_slots=torch.cat(slots).long(),
            rows=torch.tensor([r.row for r, _ in plan], dtype=torch.long, device=device),
            prefix_lens=[r.kv_len for r, _ in plan],
            extend_lens=[n for _, n in plan],
        )

    # ---- after the forward -------------------------------------------------------------------
    def _process(self, plan: list[tuple[Req, int]], hidden: torch.Tensor) -> list[Req]:
        sample_rows, sample_reqs = [], []
        offset = 0
        for req, n in plan:
            req.forward_passes += 1
            if req.wants_prompt_logprobs():
                self._prompt_logprobs(req, hidden[offset: offset + n])
            req.kv_len += n
            if n > 1 or not req.output_ids:
                self._cache_unfinished(req)  # share the prompt with requests admitted after it
            if req.tokens_to_compute == 0 and req.params.max_new_tokens == 0:  # scoring: prompt logprobs only
                req.finish_reason = FinishReason.at_length(0)
                self._finish(req)
            elif req.tokens_to_compute == 0:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(req)
            offset += n
        if not sample_reqs:
            return [r for r, _ in plan if r.finished]
        logits = self.runner.logits(hidden[sample_rows])
        banned = [self._banned_ids(r) for r in sample_reqs]
        constrained = [i for i, r in enumerate(sample_reqs) if r.guide is not None]
        out = sample(logits, sample_reqs, banned,
                     (lambda masked: self._apply_constraints(masked, sample_reqs, constrained)) if constrained else None)
        now = time.monotonic()
        for i, req in enumerate(sample_reqs):
            if out.logprobs is not None and req.params.return_logprob:
                req.output_token_logprobs.append((out.logprobs[i], out.token_ids[i]))
                if req.params.top_logprobs_num:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            req.first_token_time = req.first_token_time or now
            for token in req.guide.jump_forward(out.token_ids[i]) if req.guide else [out.token_ids[i]]:
                self._append_token(req, token)
                self.generated_tokens += 1
                if req.finished:
                    self._finish(req)
                    break
        sample_reqs += [r for r, _ in plan if r.finished and r not in sample_reqs]
        if all(n == 1 for _, n in plan):
            self._log_decode()
        return sample_reqs

    def _apply_constraints(self, logits: torch.Tensor, reqs: list[Req], rows: list[int]) -> None:
        """Set the disallowed tokens of the constrained `rows` to -inf, in place, in one batched op."""
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(reqs), logits.shape[1])
        for i in rows:
            reqs[i].guide.fill_mask(bitmask[i])
        apply_bitmask(logits, bitmask, rows)
        self.mask_time += time.perf_counter() - start

    def _prompt_logprobs(self, req: Req, hidden: torch.Tensor) -> None:
        """Logprob of each prompt token from `logprob_start_len` on, given the tokens before it."""
        first = max(req.kv_len, req.params.logprob_start_len)
        last = min(req.kv_len + len(hidden), len(req.input_ids) - 1)  # positions whose next token is in the prompt
        if first >= last:
            return
        logprobs = torch.log_softmax(self.runner.logits(hidden[first - req.kv_len: last - req.kv_len]), dim=-1)
        targets = torch.tensor(req.input_ids[first + 1: last + 1])
        picked = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        req.input_token_logprobs.extend(zip(picked, targets.tolist()))

    def _stop_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.runner.eos_token_ids
        return ids

    def _banned_ids(self, req: Req) -> list[int]:
        return sorted(self._stop_ids(req)) if len(req.output_ids) < req.params.min_new_tokens else []

    def _append_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        req.all_ids.append(token)
        params = req.params
        if req.guide is not None:
            req.guide.advance(token)
            if token != self.compiler.eos_token_id and req.guide.allowed_only_eos():
                # the constraint is complete: finish without a forward that could only yield EOS
                req.text += req.detokenizer.add(token) + req.detokenizer.flush()
                req.finish_reason = FinishReason.stop(self.compiler.eos_token_id)
                return
        if token in self._stop_ids(req):
            req.finish_reason = FinishReason.stop(token)
            req.text += req.detokenizer.flush()
            return
        delta = req.detokenizer.add(token)
        req.text += delta
        for stop in params.stop:
            pos = req.text.find(stop, max(0, len(req.text) - len(delta) - len(stop) + 1))
            if pos != -1:
                req.text = req.text[:pos]
                req.finish_reason = FinishReason.stop(stop)
                return
        if len(req.output_ids) >= params.max_new_tokens or len(req.all_ids) >= self.runner.context_length:
            req.finish_reason = FinishReason.at_length(len(req.output_ids))
            req.text += req.detokenizer.flush()

    # ---- moving slots between the request and the tree --------------------------------------
    def _insert_computed(self, req: Req) -> int:
        """Give the tree the request's computed whole pages, freeing the ones it already had;
        returns how many tokens that covers."""
        aligned = req.kv_len - req.kv_len % self.page_size
        if aligned > req.tree_len:
            row = self.req_to_token[req.row]
            already = self.tree.insert(req.all_ids[:aligned], row[:aligned].long())
            if already > req.tree_len:
                self.allocator.free(row[req.tree_len: already].long())
        return aligned

    def _cache_unfinished(self, req: Req) -> None:
        """Hand the request's computed pages to the tree and keep using the tree's copies."""
        if self.tree.disable or req.kv_len - req.kv_len % self.page_size <= req.tree_len:
            return  # with matching off nobody could reuse the pages before the request ends
        aligned = self._insert_computed(req)
        slots, node = self.tree.match_prefix(req.all_ids[:aligned])
        self.req_to_token[req.row, :aligned] = slots.to(torch.int32)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_len = node, aligned

    def _release(self, req: Req) -> None:
        """Give everything the request holds back: computed pages to the tree, the rest freed."""
        if req.row is None:
            return
        start = max(self._insert_computed(req), req.tree_len)
        if req.kv_len > start:
            self.allocator.free(self.req_to_token[req.row, start: req.kv_len].long())
        self.tree.dec_lock_ref(req.last_node)
        self.runner.req_to_token_pool.free(req.row)
        req.row, req.last_node = None, None

    def _finish(self, req: Req) -> None:
        req.finish_time = time.monotonic()
        self._ended.append(req)
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "total_tokens": self.allocator.total_tokens,
            "free_tokens": self.allocator.available(),
            "cached_tokens": self.tree.evictable_size + self.tree.protected_size,
            "evictable_tokens": self.tree.evictable_size,
            "protected_tokens": self.tree.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "cache_hit_rate": self.cached_tokens_total / max(self.prompt_tokens_total, 1),
            "num_preemptions": self.num_preemptions,
            "evicted_tokens": self.tree.evicted_tokens,
            "free_request_rows": self.runner.req_to_token_pool.available(),
            "generated_tokens": self.generated_tokens,
            "aborted_requests": self.aborted_requests,
            "peak_used_tokens": self.peak_used_tokens,
            "pins": len(self.pins),
            "step_time_s": self.step_time,
            "constraint_mask_time_s": self.mask_time,
        }

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.peak_used_tokens = 0
        return self.tree.flush()

    def memory_snapshot(self) -> dict[str, Any]:
        """Who holds which KV slot, as plain data, for checkers that must not share this code:
        the free pages, every tree node (its slots, lock count, parent), every running request's
        row split at tree_len and kv_len (and its partly filled last page), and the pinned nodes."""
        p = self.page_size
        nodes = [n for n in self.tree.all_nodes() if n is not self.tree.root]
        return {
            "page_size": p,
            "num_pages": self.allocator.num_pages,
            "free_pages": self.allocator.free_page_ids().tolist(),
            "root": self.tree.root.id,
            "nodes": [{"id": n.id, "parent": n.parent.id, "slots": n.value.tolist(), "lock_ref": n.lock_ref}
                      for n in nodes],
            "requests": [{"rid": r.rid, "last_node": r.last_node.id,
                          "tree_slots": self.req_to_token[r.row, :r.tree_len].tolist(),
                          "own_slots": self.req_to_token[r.row, r.tree_len:r.kv_len].tolist()}
                         for r in self.running],
            "pinned_nodes": [n.id for n in self.pins.values()],
            "rows": self.runner.req_to_token_pool.rows,
            "free_rows": self.runner.req_to_token_pool.available(),
            "running_rows": [r.row for r in self.running],
        }

    def check_invariants(self) -> None:
        """Invariants 2 and 3: every page has one owner, the tree is consistent, locks add up."""
        self.tree.check()
        p = self.page_size
        owners = [self.allocator.free_page_ids()]
        owners += [n.value[::p] // p for n in self.tree.all_nodes() if len(n.value)]
        for req in self.running:
            owners.append(self.req_to_token[req.row, req.tree_len: req.kv_len][::p].long() // p)
        pages = torch.cat(owners).sort().values
        expected = torch.arange(1, self.allocator.num_pages + 1, device=pages.device)
        assert len(pages) == len(expected) and bool((pages == expected).all()), \
            "KV pages leaked or owned twice"
        used_rows = {r.row for r in self.running}
        assert len(used_rows) + self.runner.req_to_token_pool.available() == self.runner.req_to_token_pool.rows
        locks: dict = {}
        for node in [r.last_node for r in self.running] + list(self.pins.values()):
            while node is not self.tree.root:
                locks[node] = locks.get(node, 0) + 1
                node = node.parent
        for node in self.tree.all_nodes():
            if node is not self.tree.root:
                assert node.lock_ref == locks.get(node, 0), "lock count differs from the requests holding it"

    # ---- logs --------------------------------------------------------------------------------
    def _usage(self) -> float:
        return 1 - self.allocator.available() / self.allocator.total_tokens

    def _log_prefill(self, admitted: list[tuple[Req, int]]) -> None:
        logger.info("prefill: %d new reqs, %d new tokens, %d cached tokens | running %d, queue %d, "
                    "token usage %.2f, cache hit rate %.2f", len(admitted), sum(n for _, n in admitted),
                    sum(r.tree_len for r, _ in admitted), len(self.running), len(self.waiting), self._usage(),
                    self.cached_tokens_total / max(self.prompt_tokens_total, 1))

    def _log_decode(self) -> None:
        self._decode_steps += 1
        if self._decode_steps % self.args.log_interval:
            return
        now = time.monotonic()
        then, tokens = self._log_mark
        self._log_mark = (now, self.generated_tokens)
        logger.info("decode: running %d, queue %d, token usage %.2f, cache hit rate %.2f, gen throughput %.1f tok/s",
                    len(self.running), len(self.waiting), self._usage(),
                    self.cached_tokens_total / max(self.prompt_tokens_total, 1),
                    (self.generated_tokens - tokens) / max(now - then, 1e-9))
