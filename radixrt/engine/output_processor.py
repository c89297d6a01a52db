"""After the forward: prompt logprobs, sampling (penalties, constraint masks, filters),
verification of drafts, jump-forward, stops and detokenizing, for one step's requests.

A request's own failure here ends that request alone: each piece of per-request work runs under
the scheduler's `guard`, and a row nothing can be drawn from ends its request through `fail`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixrt.engine.constraints import Constraints
from radixrt.engine.request import FinishReason, Req, Scheduled
from radixrt.engine.sampler import NAN_LOGITS, SampleOutput, sample
from radixrt.engine.speculation import Speculation
from radixrt.engine.stats import Counters
from radixrt.engine.stop_strings import STOP_REGEX_TIMEOUT_S, StopRegexTimeout
from radixrt.executor.tp_worker import TPDriver
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.protocol import ErrorCode
from radixrt.structured.bitmask import allocate_bitmask, apply_bitmask

PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per logits matrix


@dataclass(frozen=True)
class RequestEnds:
    """The scheduler's fault containment, which the processor ends requests through: `finish`
    (now, as decided), `fail` (with an error, freeing this step's slots past its KV), `guard`
    (run one request's own work: guard(req, work, *args), False when it raised and ended req)."""

    finish: Callable[[Req], None]
    fail: Callable[[Req, ErrorCode, str], None]
    guard: Callable[..., bool]


class OutputProcessor:
    """Turns a step's hidden states into tokens, text and finished requests."""

    def __init__(
        self,
        driver: TPDriver,
        kv: KVSlotManager,
        counters: Counters,
        constraints: Constraints,
        spec: Speculation | None,
        ends: RequestEnds,
    ):
        self.driver = driver
        self.runner = driver.runner
        self.kv = kv
        self.counters = counters
        self.constraints = constraints
        self.spec = spec
        self.finish, self.fail, self.guard = ends.finish, ends.fail, ends.guard

    def process(self, plan: list[Scheduled], hidden: torch.Tensor) -> list[Req]:
        """Advance every request of `plan` past its forward; returns those that got a token or
        finished."""
        sample_rows, sample_reqs, verifying = [], [], []
        offset = 0
        for item in plan:
            req, n = item.req, item.n
            req.forward_passes += 1
            if item.draft:
                verifying.append((item, offset))
                offset += n
                continue
            if req.wants_prompt_logprobs() and not self.guard(
                req, self._prompt_logprobs, req, hidden[offset : offset + n]
            ):
                offset += n
                continue
            if req.pooling is not None and not self.guard(
                req, req.pool, hidden[offset : offset + n]
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
                self.finish(req)
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
                self.guard(item.req, self._verify, item, logits[start : start + item.n])
                start += item.n
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
            failure = out.failures[i]
            if failure is not None:
                self._fail_unsampleable(req, failure)
            elif self.guard(req, self._take, req, out, i) and req.finished:
                self.finish(req)

    def _take(self, req: Req, out: SampleOutput, i: int) -> None:
        self._record_logprobs(req, out, i)
        self._emit(req, out.token_ids[i])

    def _fail_unsampleable(self, req: Req, why: str) -> None:
        """A row nothing could be drawn from: the model's fault (NaN) or the request's (its
        constraint and min_new_tokens left no token)."""
        code = ErrorCode.INTERNAL_ERROR if why == NAN_LOGITS else ErrorCode.INVALID_REQUEST
        self.fail(req, code, why)

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
            )
            failure = out.failures[0]
            if failure is not None:
                req.kv_len = start + rows  # the tokens confirmed so far keep their K/V
                self._fail_unsampleable(req, failure)
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
        assert self.spec is not None, "a draft without speculation"
        self.spec.verified(req, len(draft), accepted)
        if req.finished:
            self.finish(req)

    @staticmethod
    def _record_logprobs(req: Req, out: SampleOutput, i: int) -> None:
        if out.logprobs is not None and req.params.return_logprob:
            req.output_token_logprobs.append((out.logprobs[i], out.token_ids[i]))
            if req.params.top_logprobs_num:
                assert out.top_logprobs is not None, "the sampler gives top logprobs when asked"
                req.output_top_logprobs.append(out.top_logprobs[i])

    def _emit(self, req: Req, token: int) -> int:
        """Append a sampled token and the tokens its constraint forces after it (jump-forward),
        stopping when the request finishes; returns how many were appended."""
        req.first_token_time = req.first_token_time or time.monotonic()
        tokens = req.guide.jump_forward(token) if req.guide else [token]
        for i, t in enumerate(tokens):
            self._append_token(req, t)
            self.counters.generated_tokens += 1
            if req.finished:
                return i + 1
        return len(tokens)

    def _apply_constraints(self, logits: torch.Tensor, reqs: list[Req], rows: list[int]) -> None:
        """Set the disallowed tokens of the constrained `rows` to -inf, in place, in one batched op."""
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(reqs), logits.shape[1])
        for i in rows:
            guide = reqs[i].guide
            assert guide is not None, "`rows` are the constrained requests"
            guide.fill_mask(bitmask[i])
        apply_bitmask(logits, bitmask, rows)
        self.counters.mask_time += time.perf_counter() - start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.counters.logit_rows += len(hidden)
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
            picked = logprobs.gather(1, targets[:, None].to(logprobs.device)).squeeze(1)
            k = req.params.top_logprobs_num
            req.prompt_logprobs.add(picked, targets, tuple(logprobs.topk(k, dim=-1)) if k else ())

    def _stop_ids(self, req: Req) -> set[int]:
        ids = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids |= self.runner.eos_token_ids
        return ids

    def _banned_ids(self, req: Req) -> list[int]:
        return (
            sorted(self._stop_ids(req)) if len(req.output_ids) < req.params.min_new_tokens else []
        )

    def _stop_regex(self, req: Req) -> bool:
        """Whether a `stop_regex` pattern matches the text (then the request finishes there,
        the match cut unless `no_stop_trim`); a search that times out aborts the request."""
        assert req.stop_regexes is not None
        try:
            hit = req.stop_regexes.search(req.text)
        except StopRegexTimeout as e:
            req.finish_reason = FinishReason.abort(
                f"stop_regex {e} took over {STOP_REGEX_TIMEOUT_S}s to search the text",
                ErrorCode.INVALID_REQUEST,
            )
            return True
        if hit is None:
            return False
        req.text = req.text[: hit.end if req.params.no_stop_trim else hit.start]
        req.finish_reason = FinishReason.stop(req.params.stop_regex[hit.index])
        return True

    def _append_token(self, req: Req, token: int) -> None:
        """Append one token: advance the constraint, detokenize, and decide whether (and why)
        the request finishes: a complete constraint, a stop token, a stop string (cut from the
        text), or its length."""
        req.output_ids.append(token)
        req.all_ids.append(token)
        params = req.params
        if req.guide is not None:
            req.guide.advance(token)
            eos = self.constraints.eos_token_id
            if token != eos and req.guide.allowed_only_eos():
                # the constraint is complete: finish without a forward that could only yield EOS
                req.text += req.detokenizer.add(token) + req.detokenizer.flush()
                req.finish_reason = FinishReason.stop(eos)
                return
        if token in self._stop_ids(req):
            req.finish_reason = FinishReason.stop(token)
            kept = req.detokenizer.add(token) if params.no_stop_trim else ""
            req.text += kept + req.detokenizer.flush()
            return
        delta = req.detokenizer.add(token)
        req.text += delta
        hit = req.stops.feed(delta) if req.stops is not None else None
        if hit is not None:
            req.text = req.text[: hit.end if params.no_stop_trim else hit.start]
            req.finish_reason = FinishReason.stop(params.stop[hit.index])
            return
        if delta and req.stop_regexes is not None and self._stop_regex(req):
            return
        if (
            len(req.output_ids) >= params.max_new_tokens
            or len(req.all_ids) >= self.runner.context_length
        ):
            req.finish_reason = FinishReason.at_length(len(req.output_ids))
            req.text += req.detokenizer.flush()
