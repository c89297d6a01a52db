"""Cache-aware continuous batching over the paged pool and the radix cache.

Each step runs one forward over a ragged batch: one token for every decoding request, a chunk
for every request still prefilling, and chunks of newly admitted requests under the step's
token budget. Requests join and leave at every step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from radixrt.config import SchedulerArgs, ServerArgs
from radixrt.engine.budget import AdmissionBudget
from radixrt.engine.detokenizer import IncrementalDetokenizer
from radixrt.engine.request import DEFAULT_SCOPE, FinishReason, Req, RequestScope, Scheduled
from radixrt.engine.sampler import NAN_LOGITS, SampleOutput, sample
from radixrt.engine.schedule_policy import (
    Ranking,
    match_key,
    order_waiting,
    pick_victim,
    preemption_victim,
)
from radixrt.engine.tenant_stats import TenantStats
from radixrt.executor.model_loader import model_fingerprint
from radixrt.executor.tp_worker import TPDriver
from radixrt.forward_batch import ForwardBatch
from radixrt.mem_cache.host_pool import HostKVPool, host_pool_tokens
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.mem_cache.storage import STORAGE_BLOCK_TOKENS, KVStorage
from radixrt.protocol import ErrorCode, RequestError
from radixrt.sampling_params import SamplingParams
from radixrt.speculative import NgramDrafter
from radixrt.structured.bitmask import allocate_bitmask, apply_bitmask
from radixrt.structured.compiler import CompileStats, ConstraintCompiler

logger = logging.getLogger(__name__)

# defer a request sharing this many new tokens with one admitted this step
IN_BATCH_SHARE_TOKENS = 16
PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per logits matrix
HEARTBEAT_S = 1.0  # idle, rank 0 tells the other tensor-parallel ranks it is alive this often


class Scheduler:
    """The batching loop's state: waiting and running requests, the pool's slot manager, the
    tree; `step()` runs one forward. It owns the driver it is given (`driver.runner`: the model,
    its pools and tokenizer; every forward and logits call goes through the driver, which sends
    it to the other tensor-parallel ranks first)."""

    def __init__(self, args: SchedulerArgs, driver: TPDriver):
        self.args = args
        self.driver = driver
        self.runner = driver.runner
        self.tokenizer = self.runner.tokenizer
        self.allocator = self.runner.allocator
        self.req_to_token = self.runner.req_to_token_pool.req_to_token
        host = self._host_pool() if args.enable_hierarchical_cache else None
        self.tree = RadixCache(
            self.allocator.page_size,
            self.allocator.free,
            disable=args.disable_radix_cache,
            host=host,
            write_policy=args.hicache_write_policy,
        )
        self.kv = KVSlotManager(
            self.allocator,
            self.runner.req_to_token_pool,
            self.tree,
            storage=self._storage(host) if args.hicache_storage_dir else None,
            swap=(args.preemption_mode or ("swap" if host else "recompute")) == "swap",
        )
        self.host_hit_tokens = 0  # prompt tokens loaded back from the host tier at admission
        self.storage_hit_tokens = 0  # of which the disk tier had read into the host
        self.swapped_in_tokens = 0  # retracted requests' tokens loaded back at readmission
        self.budget = AdmissionBudget(args.chunked_prefill_size, args.max_prefill_tokens)
        self.ranking = Ranking(args.schedule_low_priority_values_first, args.priority_aging_s)
        self.tenants = TenantStats()
        self.priority_preemptions = 0  # retractions for a higher-priority waiting request
        self.timed_out_requests = 0
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._seeds = torch.Generator().manual_seed(args.random_seed)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.num_preemptions = 0
        self.generated_tokens = 0
        self.aborted_requests = 0  # by their clients (an abort op or a client gone silent)
        # what the forwards computed, for the benchmark's compute and bandwidth floors
        self.forward_steps = 0
        self.forward_tokens = 0
        self.attention_pairs = 0  # (query, key) pairs attended, over all requests and steps
        self.logit_rows = 0
        self.step_time = 0.0  # seconds in forward + sampling
        self.mask_time = 0.0  # of which, building and applying constraint masks
        self._decode_steps = 0
        self._log_mark = (time.monotonic(), 0)
        self._ended: list[Req] = []  # finished outside a forward (aborts), reported by step()
        # this step's requests -> the KV length their slots reach (what a failure must free)
        self._allocated: dict[Req, int] = {}
        self._admitting: Req | None = None  # the waiting request admission is looking at
        self.failed_steps = 0  # steps that raised: their requests ended with internal_error
        self.compiler: ConstraintCompiler | None = None
        self.stalled = False
        self.drafter = (
            NgramDrafter(args.speculative_num_draft_tokens)
            if args.speculative_algorithm == "ngram"
            else None
        )
        self.spec_verifications = 0  # forwards in which a request verified a draft
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self._last_heartbeat = time.monotonic()

    def _host_pool(self) -> HostKVPool:
        pool = self.runner.kv_pool
        tokens = host_pool_tokens(
            self.allocator.total_tokens, self.args.hicache_ratio, self.args.hicache_size, pool
        )
        host = HostKVPool(pool, tokens, self.allocator.page_size)
        logger.info("host tier: %d tokens (%s)", host.total_tokens, self.args.hicache_write_policy)
        return host

    def _storage(self, host: HostKVPool) -> KVStorage:
        p = self.allocator.page_size
        block = -(-STORAGE_BLOCK_TOKENS // p) * p
        like = host.device_block(torch.zeros(block, dtype=torch.long))
        model = model_fingerprint(
            self.runner.model_path, self.runner.dtype, self.runner.args.quantization
        )
        fingerprint = f"{model}|{[(t.shape, t.dtype) for t in like]}"
        return KVStorage(
            self.args.hicache_storage_dir,
            int(self.args.hicache_storage_size * 2**30),
            block,
            fingerprint,
            like,
        )

    def close(self) -> None:
        """Finish what runs in the background (the disk tier's writes), kill the constraint
        compiler's workers, and stop the model's other tensor-parallel ranks."""
        if self.kv.storage is not None:
            self.kv.storage.close()
        if self.compiler is not None:
            self.compiler.close()
        self.driver.close()

    def idle(self) -> None:
        """Called while there is no work: every second, a heartbeat to the other ranks (a dead
        rank raises here); the constraint compiler stops its idle workers."""
        if self.compiler is not None:
            self.compiler.poll()
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self.driver.heartbeat()

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> Scheduler:
        """A scheduler over a new model (and its ranks), each given its part of `args`."""
        return cls(args.scheduler, TPDriver.start(args.executor))

    # ---- requests in and out ---------------------------------------------------------------
    def make_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        sample_index: int = 0,
        scope: RequestScope = DEFAULT_SCOPE,
    ) -> Req:
        if not input_ids:
            raise ValueError("the prompt is empty")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.runner.vocab_size
            for t in input_ids
        ):
            raise ValueError(f"token ids must be ints in [0, {self.runner.vocab_size})")
        params.check_vocabulary(self.runner.vocab_size)
        limit = min(self.runner.context_length, self.allocator.total_tokens)
        if len(input_ids) >= limit:
            raise RequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(input_ids)} tokens; this server takes at most {limit - 1} "
                f"(context length {self.runner.context_length}, pool {self.allocator.total_tokens})",
            )
        seed = (
            params.seed + sample_index
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        )
        req = Req(
            rid,
            list(input_ids),
            params,
            IncrementalDetokenizer(self.tokenizer, input_ids, params.skip_special_tokens),
            torch.Generator().manual_seed(seed),
            scope=scope,
        )
        if self.drafter is not None:
            req.drafts = self.drafter.new_request(shared=not req.cache_salt)
        constraint = params.constraint()
        if constraint is not None:  # compiled in a worker process; admission waits for it
            req.constraint = self._compiler().compile_async(
                **{constraint[0]: constraint[1]}, tenant=req.scope.tenant
            )
        return req

    def _compiler(self) -> ConstraintCompiler:
        if self.compiler is None:
            self.compiler = ConstraintCompiler(
                self.tokenizer,
                self.runner.vocab_size,
                compile_timeout_s=self.args.constraint_compile_timeout,
            )
        return self.compiler

    def _constraint_ready(self, req: Req) -> bool:
        """False while the request's constraint compiles; a failed compile, or any failure to
        start its walk, ends that request alone with `invalid_constraint`."""
        if req.constraint is None or req.guide is not None:
            return True
        if not self.compiler.ready(req.constraint):
            return False
        try:
            # forced tokens get no logprobs
            jump = self.args.enable_jump_forward and not req.params.return_logprob
            req.guide = self.compiler.guide(req.constraint.result(), jump_forward=jump)
            return True
        except Exception as e:  # noqa: BLE001 (whatever the constraint raised is its own fault)
            message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            req.finish_reason = FinishReason.abort(message, ErrorCode.INVALID_CONSTRAINT)
            self._finish(req)
            return False

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)
        self.tenants.of(req.scope.tenant).requests += 1

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

    def pin(self, pin_id: str, input_ids: list[int], salt: str = "", owner: str = "") -> int:
        """Lock the cached prefix of `input_ids` under `salt` so eviction cannot take it (fork's
        shared prefix). Returns how many tokens are pinned (what the cache held). The pins whose
        ids start with `owner` (one client's) hold at most `--max-pinned-tokens-per-client`
        tokens together; past it, `rate_limited` and nothing more is pinned."""
        tokens = self.kv.pin(pin_id, input_ids, salt)
        most = self.args.max_pinned_tokens_per_client or self.allocator.total_tokens // 2
        held = self.kv.pinned_tokens(owner)
        if held > most:
            self.kv.unpin(pin_id)
            raise RequestError(
                ErrorCode.RATE_LIMITED,
                f"this client would pin {held} tokens (at most {most}); unpin some first",
            )
        return tokens

    def unpin(self, pin_id: str) -> bool:
        return self.kv.unpin(pin_id)

    def unpin_all(self, prefix: str) -> int:
        return self.kv.unpin_all(prefix)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests that got a new token or finished.

        An exception costs requests, never the loop: one pinned on a request (its sampling,
        logprobs, constraint or detokenizing) ends that request with `internal_error`; any other
        ends the step's requests so, their slots freed. Under tensor parallelism it is raised:
        the ranks' collectives are then out of step, and the process must end."""
        self._ended, self._allocated, self._admitting = [], {}, None
        try:
            updated = self._step()
        except Exception as e:
            if self.runner.tp.size > 1:
                raise
            updated = self._fail_step(e)
        return updated + [r for r in self._ended if r not in updated]

    def _step(self) -> list[Req]:
        self._expire(time.monotonic())
        plan = self._schedule()
        self.stalled = not plan  # e.g. every waiting request's constraint is still compiling
        self.forward_steps += bool(plan)
        self.forward_tokens += sum(s.n for s in plan)
        # n new tokens after kv_len cached ones attend to kv_len + 1 ... kv_len + n keys
        self.attention_pairs += sum(s.n * s.req.kv_len + s.n * (s.n + 1) // 2 for s in plan)
        start = time.perf_counter()
        updated = self._process(plan, self.driver.forward(self._build_batch(plan))) if plan else []
        seconds = time.perf_counter() - start
        self.step_time += seconds
        if self.drafter is not None and plan and _decodes_only(plan):
            verifying = sum(bool(s.draft) for s in plan)
            self.drafter.cost.observe(sum(s.n for s in plan), verifying, seconds)
        return updated

    def _fail_step(self, error: Exception) -> list[Req]:
        """End the failed step's requests (or, when it failed before any was scheduled, the one
        being admitted) with `internal_error`; a request's own failure is logged and skipped so
        the rest still end."""
        self.failed_steps += 1
        victims = list(self._allocated) or ([self._admitting] if self._admitting else [])
        logger.exception("a step failed; %d of its requests end with internal_error", len(victims))
        message = f"the runtime failed on this request's step: {type(error).__name__}: {error}"
        for req in victims:
            if req.finished:
                continue
            try:
                self._fail(req, ErrorCode.INTERNAL_ERROR, message)
            except Exception:
                logger.exception("could not free request %s after a failed step", req.rid)
        return victims

    def _fail(self, req: Req, code: ErrorCode, message: str) -> None:
        """End `req` with an error now, freeing the slots this step gave it past its KV."""
        req.finish_reason = FinishReason.abort(message, code)
        allocated = self._allocated.pop(req, None)
        if allocated is not None and req.row is not None:
            self.kv.trim(req, allocated)
        self._finish(req)

    def _guard(self, req: Req, work: Callable[..., Any], *args: Any) -> bool:
        """Run one request's own `work`; an exception ends that request alone (logged) and
        returns False."""
        try:
            work(*args)
            return True
        except Exception as e:
            logger.exception("request %s failed", req.rid)
            self._fail(req, ErrorCode.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            return False

    def _expire(self, now: float) -> None:
        """End every request past its deadline with `timeout`; its slots are freed here."""
        for req in [r for r in self.waiting + self.running if r.deadline and now >= r.deadline]:
            req.finish_reason = FinishReason.abort(
                f"the request's timeout of {req.scope.timeout} s passed", ErrorCode.TIMEOUT
            )
            self.timed_out_requests += 1
            self.tenants.of(req.scope.tenant).timeouts += 1
            self._finish(req)

    def end_all(self, error: ErrorCode, message: str) -> list[Req]:
        """End every waiting and running request with `error` (a drain that ran out of time)."""
        ended = self.waiting + self.running
        for req in ended:
            req.finish_reason = FinishReason.abort(message, error)
            self._finish(req)
        return ended

    def _schedule(self) -> list[Scheduled]:
        if self.args.enable_priority_preemption:
            self._preempt_for_priority()
        self.budget.decay()
        left = self.budget.step_tokens()
        plan = []
        for req in self.running:
            if req.tokens_to_compute == 1:
                plan.append(Scheduled(req, 1))
                continue
            n = self.budget.chunk(req.tokens_to_compute, left)
            if n:
                plan.append(Scheduled(req, n))
                left -= n
        if self.drafter is not None:
            decoding = sum(s.req.tokens_to_compute == 1 for s in plan)
            prices = self.drafter.cost.prices(sum(s.n for s in plan), decoding)
            drafts = [self._draft(s, prices) for s in plan]
            plan = [Scheduled(s.req, s.n + len(d), d) for s, d in zip(plan, drafts)]
        retractions = self.num_preemptions
        plan = self._allocate_running(plan)
        if self.args.schedule_mode == "static":
            if (
                not self.running
            ):  # the whole next batch boards at once, its prompts chunked as usual
                plan += self._admit(left=1 << 62, busy=False, defer_shared=False)
        elif self.num_preemptions == retractions:  # memory is tight right after a retraction
            plan += self._admit(left, bool(plan))
        return plan

    def _draft(self, item: Scheduled, prices: tuple[float, float]) -> tuple[int, ...]:
        """Speculative tokens for a decoding request to verify this step, as many as are worth
        their `prices` (none for a prefill chunk), cut where its constraint would reject them
        and where its limits would end it anyway."""
        req = item.req
        if req.tokens_to_compute != 1 or not req.output_ids:
            return ()
        limit = min(req.remaining_new_tokens() - 1, self.runner.context_length - len(req.all_ids))
        draft = self.drafter.propose(req.drafts, req.all_ids, limit, prices)
        if req.guide is not None:
            draft = draft[: req.guide.allowed_prefix(draft)]
        return tuple(draft)

    def _slots_needed(self, plan: list[Scheduled]) -> int:
        return sum(self.kv.slots_needed(s.req, s.n) for s in plan)

    def _allocate_running(self, plan: list[Scheduled]) -> list[Scheduled]:
        """Give every running request slots for its step, evicting then retracting if short;
        drafts are dropped before anything is retracted."""
        if self._slots_needed(plan) > self.kv.available():
            plan = [Scheduled(s.req, s.n - len(s.draft)) for s in plan]
        while self._slots_needed(plan) > self.kv.available():
            victim = pick_victim([s.req for s in plan], self.ranking)
            if victim is None:
                break
            self._retract(victim)
            plan = [s for s in plan if s.req is not victim]
        kept = []
        for item in plan:
            if self.kv.extend(item.req, item.n):
                self._allocated[item.req] = item.req.kv_len + item.n
                kept.append(item)
            else:  # a lone request larger than the whole pool
                item.req.finish_reason = FinishReason.abort("the KV pool cannot hold this request")
                self._finish(item.req)
        return kept

    def _retract(self, req: Req) -> None:
        """Take a running request's slots back (its computed pages stay in the tree; with swap
        preemption they are backed up to the host too) and queue it first: it is recomputed
        later, mostly from its own cached prefix, or loaded back from the host."""
        self.kv.retract(req)
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.budget.reset()
        self.waiting.insert(0, req)
        logger.info(
            "retracted request %s after %d tokens (pool full); it will be %s",
            req.rid,
            len(req.output_ids),
            "loaded back from the host" if self.kv.swap else "recomputed",
        )

    def _preempt_for_priority(self) -> None:
        """While the best-ranked waiting request could not be admitted for lack of room (or of a
        running slot), retract the lowest-ranked running request ranked below it."""
        if not self.waiting or not self.running:
            return
        now = time.monotonic()
        head = max(self.waiting, key=lambda r: self.ranking.rank(r, now))
        if not self._constraint_ready(head):
            return
        rank = self.ranking.rank(head, now)
        while not self._could_admit(head):
            victim = preemption_victim(self.running, rank, self.ranking, now)
            if victim is None:
                return
            self._retract(victim)
            self.priority_preemptions += 1

    def _could_admit(self, req: Req) -> bool:
        """Whether `_admit` would find room for the request's first chunk and what it will need
        later, next to what running requests will need."""
        if len(self.running) >= self.args.max_running_requests:
            return False
        if self.runner.req_to_token_pool.available() == 0:
            return False
        extend = len(req.all_ids) - self.tree.match_prefix(match_key(req), req.cache_salt).length
        n = self.budget.chunk(extend, self.budget.step_tokens()) or extend
        future = self.budget.expected(extend - n, req.remaining_new_tokens())
        return self.kv.available() - self._reserved_tokens() >= n + future

    def _reserved_tokens(self) -> float:
        return sum(
            self.budget.expected(r.tokens_to_compute - 1, r.remaining_new_tokens())
            for r in self.running
        )

    def _admit(self, left: int, busy: bool, defer_shared: bool = True) -> list[Scheduled]:
        """Admit waiting requests in policy order while the step's prompt tokens (`left`), the
        running-request limit and the pool's room (less what running requests will need) allow."""
        admitted: list[Scheduled] = []
        if not self.waiting:
            return admitted
        reserved = self._reserved_tokens()
        shared_keys: set[tuple[int, ...]] = set()
        for req in order_waiting(self.args.schedule_policy, self.waiting, self.tree, self.ranking):
            if len(self.running) >= self.args.max_running_requests or left <= 0:
                break
            self._admitting = req
            if not self._constraint_ready(req):
                continue
            if self.runner.req_to_token_pool.available() == 0:
                break
            match = self.kv.match_prefix(match_key(req), req.cache_salt)
            m = match.length
            if (
                defer_shared
                and not self.tree.disable
                and len(req.all_ids) - m > IN_BATCH_SHARE_TOKENS
            ):
                key = tuple(req.all_ids[m : m + IN_BATCH_SHARE_TOKENS])
                if key in shared_keys:
                    continue  # prefilled next step, on top of what this step caches
                shared_keys.add(key)
            self.kv.lock(match.end_node)  # from here the matched prefix is not evictable room
            device = self.kv.load_back(match)  # the host part onto the device, lock moved
            m = len(device.slots)
            extend = len(req.all_ids) - m
            n = self.budget.chunk(extend, left)
            if n == 0:
                if busy or admitted:
                    self.kv.unlock(device.node)
                    break
                n = extend  # an unchunked prompt over the budget runs alone
            future = self.budget.expected(extend - n, req.remaining_new_tokens())
            if (self.running or admitted) and self.kv.available() - reserved < n + future:
                self.kv.unlock(device.node)
                break
            self.tree.record_hit(device.node)
            if not self.kv.admit(req, device, n):
                break
            self._allocated[req] = req.kv_len + n
            self._count_admission(req, m, m - len(match.slots), match.storage_tokens)
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(Scheduled(req, n))
            left -= n
            reserved += future
        if admitted:
            self._log_prefill(admitted)
        return admitted

    def _count_admission(self, req: Req, cached: int, loaded: int, from_storage: int) -> None:
        """Cache-hit accounting, once per request (a retracted one is admitted again: what it
        loads back then counts as swapped in). `cached` tokens were not recomputed; `loaded` of
        them came from the host tier, which had just read `from_storage` from the disk tier
        (all of them when they were loaded at all)."""
        from_storage = from_storage if loaded else 0
        if req.admitted_once:
            self.swapped_in_tokens += loaded
            return
        req.admitted_once = True
        req.cached_tokens = min(cached, len(req.input_ids))
        self.tenants.of(req.scope.tenant).admitted(len(req.input_ids), req.cached_tokens)
        req.host_cached_tokens = loaded - from_storage
        req.storage_cached_tokens = from_storage
        self.prompt_tokens_total += len(req.input_ids)
        self.cached_tokens_total += req.cached_tokens
        self.host_hit_tokens += loaded - from_storage
        self.storage_hit_tokens += from_storage

    def _build_batch(self, plan: list[Scheduled]) -> ForwardBatch:
        ids, positions, slots = [], [], []
        for item in plan:
            req, n = item.req, item.n
            ids.extend(item.input_ids())
            positions.extend(range(req.kv_len, req.kv_len + n))
            slots.append(self.req_to_token[req.row, req.kv_len : req.kv_len + n])
        device = self.runner.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            out_slots=torch.cat(slots).long(),
            rows=torch.tensor([s.req.row for s in plan], dtype=torch.long, device=device),
            prefix_lens=[s.req.kv_len for s in plan],
            extend_lens=[s.n for s in plan],
        )

    # ---- after the forward -------------------------------------------------------------------
    def _process(self, plan: list[Scheduled], hidden: torch.Tensor) -> list[Req]:
        sample_rows, sample_reqs, verifying = [], [], []
        offset = 0
        for item in plan:
            req, n = item.req, item.n
            req.forward_passes += 1
            if item.draft:
                verifying.append((item, offset))
                offset += n
                continue
            if req.wants_prompt_logprobs() and not self._guard(
                req, self._prompt_logprobs, req, hidden[offset : offset + n]
            ):
                offset += n
                continue
            req.kv_len += n
            if n > 1 or not req.output_ids:
                self.kv.cache_unfinished(req)  # share the prompt with requests admitted after it
            if (
                req.tokens_to_compute == 0 and req.params.max_new_tokens == 0
            ):  # scoring: prompt logprobs only
                req.finish_reason = FinishReason.at_length(0)
                self._finish(req)
            elif req.tokens_to_compute == 0:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(req)
            offset += n
        if sample_reqs:
            self._sample(sample_reqs, hidden[sample_rows])
        if verifying:
            rows = [start + i for item, start in verifying for i in range(item.n)]
            logits = self._logits(hidden[rows])
            start = 0
            for item, _ in verifying:
                self._guard(item.req, self._verify, item, logits[start : start + item.n])
                start += item.n
        if _decodes_only(plan):
            self._log_decode()
        done = sample_reqs + [item.req for item, _ in verifying]
        return done + [s.req for s in plan if s.req.finished and s.req not in done]

    def _sample(self, reqs: list[Req], hidden: torch.Tensor) -> None:
        """One token for each of `reqs` (with what it forces after it) from its row of `hidden`."""
        logits = self._logits(hidden)
        banned = [self._banned_ids(r) for r in reqs]
        constrained = [i for i, r in enumerate(reqs) if r.guide is not None]
        out = sample(
            logits,
            reqs,
            banned,
            (lambda masked: self._apply_constraints(masked, reqs, constrained))
            if constrained
            else None,
        )
        for i, req in enumerate(reqs):
            if out.failures[i] is not None:
                self._fail_unsampleable(req, out.failures[i])
            elif self._guard(req, self._take, req, out, i) and req.finished:
                self._finish(req)

    def _take(self, req: Req, out: SampleOutput, i: int) -> None:
        self._record_logprobs(req, out, i)
        self._emit(req, out.token_ids[i])

    def _fail_unsampleable(self, req: Req, why: str) -> None:
        """A row nothing could be drawn from: the model's fault (NaN) or the request's (its
        constraint and min_new_tokens left no token)."""
        code = ErrorCode.INTERNAL_ERROR if why == NAN_LOGITS else ErrorCode.INVALID_REQUEST
        self._fail(req, code, why)

    def _verify(self, item: Scheduled, logits: torch.Tensor) -> None:
        """Accept the longest prefix of the request's drafts that the sampler agrees with, then
        the sampler's own next token; free the slots of the rejected drafts' K/V.

        Row i of `logits` follows the request's last token then drafts 0..i-1. It is sampled
        after the tokens before it are appended (so penalties, min_new_tokens and the constraint
        see them), exactly as a decode step would. Verification stops at the first token that is
        not the draft, when the request finishes, or when a constraint forces text after a token
        (the forced tokens are computed next step)."""
        req, draft = item.req, item.draft
        start, rows, accepted = req.kv_len, 0, 0
        for i in range(len(draft) + 1):
            proposed = draft[i] if i < len(draft) else None
            out = sample(
                logits[i : i + 1],
                [req],
                [self._banned_ids(req)],
                (lambda masked: self._apply_constraints(masked, [req], [0]))
                if req.guide is not None
                else None,
                [proposed],
            )
            if out.failures[0] is not None:
                req.kv_len = start + rows  # the tokens confirmed so far keep their K/V
                self._fail_unsampleable(req, out.failures[0])
                return
            token = out.token_ids[0]
            self._record_logprobs(req, out, 0)
            rows = i + 1
            accepted += token == proposed
            forced = self._emit(req, token)
            if token != proposed or req.finished or forced > 1:
                break
        req.kv_len = start + rows  # the inputs of the rows used: all confirmed tokens
        self.kv.trim(req, start + item.n)
        self.drafter.observe(req.drafts, len(draft), accepted)
        self.spec_verifications += 1
        self.spec_draft_tokens += len(draft)
        self.spec_accepted_tokens += accepted
        if req.finished:
            self._finish(req)

    @staticmethod
    def _record_logprobs(req: Req, out: SampleOutput, i: int) -> None:
        if out.logprobs is not None and req.params.return_logprob:
            req.output_token_logprobs.append((out.logprobs[i], out.token_ids[i]))
            if req.params.top_logprobs_num:
                req.output_top_logprobs.append(out.top_logprobs[i])

    def _emit(self, req: Req, token: int) -> int:
        """Append a sampled token and the tokens its constraint forces after it (jump-forward),
        stopping when the request finishes; returns how many were appended."""
        req.first_token_time = req.first_token_time or time.monotonic()
        tokens = req.guide.jump_forward(token) if req.guide else [token]
        for i, t in enumerate(tokens):
            self._append_token(req, t)
            self.generated_tokens += 1
            if req.finished:
                return i + 1
        return len(tokens)

    def _apply_constraints(self, logits: torch.Tensor, reqs: list[Req], rows: list[int]) -> None:
        """Set the disallowed tokens of the constrained `rows` to -inf, in place, in one batched op."""
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(reqs), logits.shape[1])
        for i in rows:
            reqs[i].guide.fill_mask(bitmask[i])
        apply_bitmask(logits, bitmask, rows)
        self.mask_time += time.perf_counter() - start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.logit_rows += len(hidden)
        return self.driver.logits(hidden)

    def _prompt_logprobs(self, req: Req, hidden: torch.Tensor) -> None:
        """Logprob of each prompt token from `logprob_start_len` on, given the tokens before it,
        and the `top_logprobs_num` most likely tokens at each of those positions."""
        first = max(req.kv_len, req.params.logprob_start_len)
        # positions whose next token is in the prompt
        last = min(req.kv_len + len(hidden), len(req.input_ids) - 1)
        # rows of vocabulary-wide logits at a time: a long scored prompt must not hold
        # [prompt, vocab] floats at once (4096 x 49152 is 800 MB, twice over with log_softmax)
        for lo in range(first, last, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, last)
            logprobs = torch.log_softmax(
                self._logits(hidden[lo - req.kv_len : hi - req.kv_len]), dim=-1
            )
            targets = torch.tensor(req.input_ids[lo + 1 : hi + 1])
            picked = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            req.input_token_logprobs.extend(zip(picked, targets.tolist()))
            if k := req.params.top_logprobs_num:
                vals, ids = logprobs.topk(k, dim=-1)
                req.input_top_logprobs.extend(
                    list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())
                )

    def _stop_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.runner.eos_token_ids
        return ids

    def _banned_ids(self, req: Req) -> list[int]:
        return (
            sorted(self._stop_ids(req)) if len(req.output_ids) < req.params.min_new_tokens else []
        )

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
        if (
            len(req.output_ids) >= params.max_new_tokens
            or len(req.all_ids) >= self.runner.context_length
        ):
            req.finish_reason = FinishReason.at_length(len(req.output_ids))
            req.text += req.detokenizer.flush()

    def _finish(self, req: Req) -> None:
        req.finish_time = time.monotonic()
        if self.drafter is not None and req.output_ids and not req.cache_salt:
            self.drafter.remember(req.all_ids)
        self._ended.append(req)
        if req in self.running:
            self.kv.release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "tp_size": self.runner.tp.size,
            "tp_collective_time_s": self.runner.tp.collective_time,  # rank 0's, in step_time_s
            "total_tokens": self.allocator.total_tokens,
            "free_tokens": self.allocator.available(),
            "cached_tokens": self.tree.evictable_size + self.tree.protected_size,
            "evictable_tokens": self.tree.evictable_size,
            "protected_tokens": self.tree.protected_size,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "cache_hit_rate": self.cached_tokens_total / max(self.prompt_tokens_total, 1),
            # the rate's two sides, so a router can add them up over its workers
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_prompt_tokens_total": self.cached_tokens_total,
            "num_preemptions": self.num_preemptions,
            "priority_preemptions": self.priority_preemptions,
            "timed_out_requests": self.timed_out_requests,
            "cache_salts": len(self.tree.roots),
            "tenants": self.tenants.snapshot(self.waiting, self.running),
            "evicted_tokens": self.tree.evicted_tokens,
            "free_request_rows": self.runner.req_to_token_pool.available(),
            "generated_tokens": self.generated_tokens,
            "aborted_requests": self.aborted_requests,
            "failed_steps": self.failed_steps,
            "peak_used_tokens": self.kv.peak_used_tokens,
            "pins": len(self.kv.pins),
            "step_time_s": self.step_time,
            "forward_steps": self.forward_steps,
            "forward_tokens": self.forward_tokens,
            "attention_pairs": self.attention_pairs,
            "logit_rows": self.logit_rows,
            "constraint_mask_time_s": self.mask_time,
            "constraint_compiles": dataclasses.asdict(
                self.compiler.stats() if self.compiler else CompileStats()
            ),
            "host_total_tokens": self.kv.host.total_tokens if self.kv.host else 0,
            "host_used_tokens": self.kv.host.used_tokens() if self.kv.host else 0,
            "host_hit_tokens": self.host_hit_tokens,
            "storage_hit_tokens": self.storage_hit_tokens,
            "storage_rejected_blocks": self.kv.storage.rejected_blocks if self.kv.storage else 0,
            "swapped_out_tokens": self.kv.swapped_out_tokens,
            "swapped_in_tokens": self.swapped_in_tokens,
            "spec_verifications": self.spec_verifications,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            # tokens a request gets from one forward that verifies its draft (1 = no gain)
            "spec_accept_length": 1 + self.spec_accepted_tokens / max(self.spec_verifications, 1),
        }

    def flush_cache(self) -> bool:
        return not self.has_work() and self.kv.flush()

    def memory_snapshot(self) -> dict[str, Any]:
        """Who holds which KV slot, as plain data (see `KVSlotManager.snapshot`)."""
        return self.kv.snapshot(self.running, [r.rid for r in self.running])

    def check_invariants(self) -> None:
        """Invariants 2 and 3: every page has one owner, the tree is consistent, locks add up."""
        self.kv.check(self.running)

    # ---- logs --------------------------------------------------------------------------------
    def _usage(self) -> float:
        return 1 - self.allocator.available() / self.allocator.total_tokens

    def _log_prefill(self, admitted: list[Scheduled]) -> None:
        logger.info(
            "prefill: %d new reqs, %d new tokens, %d cached tokens | running %d, queue %d, "
            "token usage %.2f, cache hit rate %.2f",
            len(admitted),
            sum(s.n for s in admitted),
            sum(s.req.tree_len for s in admitted),
            len(self.running),
            len(self.waiting),
            self._usage(),
            self.cached_tokens_total / max(self.prompt_tokens_total, 1),
        )

    def _log_decode(self) -> None:
        self._decode_steps += 1
        if self._decode_steps % self.args.log_interval:
            return
        now = time.monotonic()
        then, tokens = self._log_mark
        self._log_mark = (now, self.generated_tokens)
        logger.info(
            "decode: running %d, queue %d, token usage %.2f, cache hit rate %.2f, gen throughput %.1f tok/s",
            len(self.running),
            len(self.waiting),
            self._usage(),
            self.cached_tokens_total / max(self.prompt_tokens_total, 1),
            (self.generated_tokens - tokens) / max(now - then, 1e-9),
        )


def _decodes_only(plan: list[Scheduled]) -> bool:
    """Every request in the step decodes (one token, or its last token and a draft)."""
    return all(s.n == 1 or s.draft for s in plan)
