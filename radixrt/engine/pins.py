"""Pins' one shared budget: what all clients' pins together may hold of the KV pool, each
owner's share of it, and the release of pins held past their share when a pin or a request
needs the room.

A pin (a fork's shared prefix, kept cached on a client's behalf) only keeps a prefix in the
cache: releasing one changes no result, only what a later request recomputes. So pins never
keep a request waiting: `--max-pinned-fraction` of the pool is all they may hold together,
and an owner (a tenant, or one client connection) holding more than its share of that budget
loses its oldest pins first when another pin or a request needs the room. A request that
still finds no room (nothing runs, and pins within their shares hold what it needs) is
refused by the planner with `overloaded`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.protocol import ErrorCode, RequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinLimits:
    """`budget`: the tokens all pins together may hold (`--max-pinned-fraction` of the pool);
    `per_owner`: the tokens one owner's pins may hold (`--max-pinned-tokens-per-client`, at
    most the budget); `pins_per_owner`: how many pins one owner may hold
    (`--max-pins-per-tenant`). Pinned tokens are counted per pin, so a prefix two pins share
    counts twice and the counts bound what pins hold from above."""

    budget: int
    per_owner: int
    pins_per_owner: int

    @classmethod
    def of(
        cls, total_tokens: int, fraction: float, per_owner: int | None, pins_per_owner: int
    ) -> PinLimits:
        budget = int(total_tokens * fraction)
        return cls(budget, min(per_owner or budget, budget), pins_per_owner)


class PinBook:
    """The pin policy over the slot manager's pins (which hold the locks)."""

    def __init__(self, kv: KVSlotManager, limits: PinLimits):
        self.kv = kv
        self.limits = limits

    def pin(self, pin_id: str, input_ids: list[int], salt: str, owner: str) -> int:
        """Pin the cached prefix of `input_ids` under `salt` for `owner`; returns its tokens.
        Refused with `invalid_request` when nothing of it is cached (the pin would hold
        nothing), `rate_limited` past the owner's count or tokens; past the shared budget,
        other owners' pins held beyond their shares are released first, and `rate_limited`
        when that is not enough. A refused pin holds nothing."""
        limits = self.limits
        count = self.kv.pin_count(owner)
        if count >= limits.pins_per_owner:
            raise RequestError(
                ErrorCode.RATE_LIMITED,
                f"{count} pins are held (at most {limits.pins_per_owner}, "
                "--max-pins-per-tenant); unpin some first",
            )
        tokens = self.kv.pin(pin_id, input_ids, salt, owner)
        try:
            self._check(tokens, owner)
        except RequestError:
            self.kv.unpin(pin_id)
            raise
        return tokens

    def _check(self, tokens: int, owner: str) -> None:
        if tokens == 0:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                "no token of this prompt is cached (under its cache_salt): a pin holds a prefix "
                "that a request has computed; run one first",
            )
        held, most = self.kv.pinned_tokens(owner), self.limits.per_owner
        if held > most:
            raise RequestError(
                ErrorCode.RATE_LIMITED,
                f"these pins would hold {held} tokens together (at most {most}, "
                "--max-pinned-tokens-per-client); unpin some first",
            )
        while self.pinned() > self.limits.budget and self._release_one(spare=owner):
            pass
        if self.pinned() > self.limits.budget:
            raise RequestError(
                ErrorCode.RATE_LIMITED,
                f"all pins would hold {self.pinned()} tokens together (at most "
                f"{self.limits.budget}, --max-pinned-fraction of the KV pool), each within "
                "its owner's share; unpin some first",
            )

    def make_room(self, need: int) -> bool:
        """Release pins held beyond their owners' shares, the most over first, until `need`
        slots can be had; whether they can. The share keeps one part of the budget for
        whoever needs the room: budget / (owners holding pins + 1)."""
        while self.kv.available() < need:
            if not self._release_one(spare=None):
                return False
        return True

    def pinned(self) -> int:
        return sum(p.tokens for p in self.kv.pins.values())

    def _release_one(self, spare: str | None) -> bool:
        """Unpin the oldest pin of the owner most over its share (never `spare`'s, the owner
        asking); False when no owner is over its share."""
        held: Counter[str] = Counter()
        for pin in self.kv.pins.values():
            held[pin.owner] += pin.tokens
        share = self.limits.budget // (len(held) + (spare is None or spare not in held))
        over = {o: t - share for o, t in held.items() if t > share and o != spare}
        if not over:
            return False
        owner = max(over, key=lambda o: over[o])
        pin_id = next(i for i, p in self.kv.pins.items() if p.owner == owner)
        self.kv.unpin(pin_id)
        logger.info(
            "released pin %s: its owner held %d pinned tokens, %d over its share %d",
            pin_id,
            held[owner],
            over[owner],
            share,
        )
        return True
