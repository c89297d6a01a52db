"""How many tokens a request drafts next: as many as are likely enough to be accepted to pay
for the rows they add to the step.

A drafted token costs a row of the forward. At batch 1 on a CPU a few more rows cost almost
nothing (the step reads the weights either way), so even a 10% chance pays; at batch 8 the step
is compute-bound and a row costs about half a token of everyone's output, so only likely drafts
pay. `StepCost` fits the step's time to its rows online and prices a drafted token in tokens of
output; `DraftLength` keeps each request's acceptance rate and drafts the i-th token only while
rate**i (the chance it is accepted: every token before it must be too) is at least that price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_RATE = 0.6  # the first requests' acceptance rate: drafting is tried first
RATE_WEIGHT = 0.3  # of the latest verification in a request's rate (a moving average)
SERVER_RATE_WEIGHT = 0.05  # of the latest verification in the server's rate, a new request's prior
PROBE_STEPS = 16  # a request not worth drafting for still drafts one token this often
PRIOR_ROW_SHARE = 0.04  # a row's time over a one-row step's, until the fit has seen enough steps
COST_DECAY = 0.98  # per observed step: the fit follows the context lengths as they grow
MIN_ROW_SPREAD = 4.0  # the fit's row variance must reach this before it is trusted


@dataclass
class DraftLength:
    """Per request: its acceptance rate (the chance that a drafted token is accepted, given the
    ones before it were) and the steps since it last drafted."""

    limit: int
    rate: float = PRIOR_RATE
    idle: int = 0

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("the draft length limit must be >= 1")

    def next(self, price: float) -> int:
        """Tokens to draft when a drafted token costs `price` tokens of output: the longest i
        (up to `limit`) with rate**i >= price; none worth it: one every PROBE_STEPS steps, so
        the rate can recover when the text turns repetitive."""
        k, chance = 0, self.rate
        while k < self.limit and chance >= price:
            k += 1
            chance *= self.rate
        self.idle = 0 if k else self.idle + 1
        if self.idle >= PROBE_STEPS:
            self.idle, k = 0, 1
        return k

    def update(self, offered: int, accepted: int, weight: float = RATE_WEIGHT) -> None:
        """After a verification of `offered` drafted tokens of which the first `accepted` were
        kept: `accepted` successes, then one failure unless all were kept."""
        if offered == 0:
            return
        seen = accepted + (accepted < offered)
        self.rate += weight * (accepted / seen - self.rate)


class StepCost:
    """A forward's seconds as a + b * rows, fitted by exponentially weighted least squares over
    steps of decodes and verifications (prefill chunks cost by their context, not their rows)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self._w = d * self._w + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def row_share(self) -> float:
        """b / a: a row's time over the fixed part of a step (the prior until the fit is sure)."""
        if self._w == 0:
            return PRIOR_ROW_SHARE
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x**2
        if spread < MIN_ROW_SPREAD:
            return PRIOR_ROW_SHARE
        b = (self._xy / self._w - mean_x * mean_y) / spread
        a = mean_y - b * mean_x
        return max(b, 0.0) / a if a > 0 else math.inf

    def price(self, rows: int) -> float:
        """What one more row costs a step of `rows` rows that yields `rows` tokens, in tokens:
        rows * b / (a + b * rows)."""
        share = self.row_share()
        return 1.0 if math.isinf(share) else rows * share / (1 + share * rows)
