"""Speculative decoding as one object: `Speculation` exists only when it is on (the scheduler
holds None otherwise), and owns the drafter, the drafts a step carries and their counters.

Verifying a draft is sampling, so `OutputProcessor.verify` does it and reports here.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.config import SchedulerArgs
from radixrt.engine.request import Req, Scheduled
from radixrt.speculative import NgramDrafter, RequestDrafts


@dataclass
class SpecCounters:
    """Forwards in which a request verified a draft, the tokens drafted, those accepted."""

    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _drafts(req: Req) -> RequestDrafts:
    """The request's drafting state, which `Speculation.start` gave it."""
    assert req.drafts is not None, "speculation did not start this request"
    return req.drafts


class Speculation:
    """N-gram drafting (`--speculative-algorithm ngram`): each decoding request may carry a
    draft into the step, priced by what a drafted row costs; the drafter learns from the
    verifications and from finished requests."""

    def __init__(self, num_draft_tokens: int, context_length: int):
        self.drafter = NgramDrafter(num_draft_tokens)
        self.context_length = context_length
        self.counters = SpecCounters()

    @classmethod
    def from_args(cls, args: SchedulerArgs, context_length: int) -> Speculation | None:
        """The speculation `args` ask for, or None when it is off."""
        if args.speculative_algorithm != "ngram":
            return None
        return cls(args.speculative_num_draft_tokens, context_length)

    def start(self, req: Req) -> None:
        """A new request's drafting state (a salted request drafts only from its own tokens)."""
        req.drafts = self.drafter.new_request(shared=not req.cache_salt)

    def add_drafts(self, plan: list[Scheduled]) -> list[Scheduled]:
        """`plan` with a draft on each decoding request, as long as is worth its price in
        this step's batch."""
        decoding = sum(s.req.tokens_to_compute == 1 for s in plan)
        prices = self.drafter.cost.prices(sum(s.n for s in plan), decoding)
        drafts = [self._draft(s, prices) for s in plan]
        return [Scheduled(s.req, s.n + len(d), d) for s, d in zip(plan, drafts)]

    def _draft(self, item: Scheduled, prices: tuple[float, float]) -> tuple[int, ...]:
        """Speculative tokens for a decoding request to verify this step, as many as are worth
        their `prices` (none for a prefill chunk), cut where its constraint would reject them
        and where its limits would end it anyway."""
        req = item.req
        if req.tokens_to_compute != 1 or not req.output_ids:
            return ()
        limit = min(req.remaining_new_tokens() - 1, self.context_length - len(req.all_ids))
        draft = self.drafter.propose(_drafts(req), req.all_ids, limit, prices)
        if req.guide is not None:
            draft = draft[: req.guide.allowed_prefix(draft)]
        return tuple(draft)

    def observe_step(self, plan: list[Scheduled], seconds: float) -> None:
        """A step's time, for the price of a drafted row (decode-only steps fit the model)."""
        if plan and decodes_only(plan):
            verifying = sum(bool(s.draft) for s in plan)
            self.drafter.cost.observe(sum(s.n for s in plan), verifying, seconds)

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        """A request verified `drafted` tokens and kept `accepted` of them."""
        self.drafter.observe(_drafts(req), drafted, accepted)
        self.counters.verifications += 1
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted

    def finished(self, req: Req) -> None:
        """A finished request's tokens join the corpus later drafts come from (not a salted
        request's: its tokens are its tenant's)."""
        if req.output_ids and not req.cache_salt:
            self.drafter.remember(req.all_ids)


def decodes_only(plan: list[Scheduled]) -> bool:
    """Every request in the step decodes (one token, or its last token and a draft)."""
    return all(s.n == 1 or s.draft for s in plan)
