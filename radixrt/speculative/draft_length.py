"""How many tokens a request drafts next: as many as are likely enough to be accepted to pay
for the rows they add to the step.

A drafted token costs a row of the forward. At batch 1 on a CPU a few more rows cost almost
nothing (the step reads the weights either way) once the first has turned the matrix-vector
product into a matrix-matrix one; at batch 8 the step is compute-bound and a row costs about half
a token of everyone's output, so only likely drafts pay. `StepCost` fits the step's time online
and prices drafted tokens in tokens of output; `DraftLength` keeps each request's acceptance rate
(the i-th drafted token is accepted with chance rate**i: every token before it must be too) and
drafts as many as pay for themselves by the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_RATE = 0.6  # the first requests' acceptance rate: drafting is tried first
RATE_WEIGHT = 0.3  # of the latest verification in a request's rate (a moving average)
SERVER_RATE_WEIGHT = 0.05  # of the latest verification in the server's rate, a new request's prior
PROBE_STEPS = 16  # a request not worth drafting for still drafts one token this often
PRIOR_ROW_SHARE = 0.04  # b / a: a row's time over a step's fixed part (float32, 2 cores)
PRIOR_VERIFY_SHARE = 0.15  # c / a: a verifying request's time beyond its rows, likewise
PRIOR_WEIGHT = 1.0  # of the priors, in steps
COST_DECAY = 0.98  # per observed step: the fit follows the context lengths as they grow


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

    def next(self, first_price: float, next_price: float, rate: float | None = None) -> int:
        """Tokens to draft when the first costs `first_price` tokens of output and each further
        one `next_price`: the k (up to `limit`) whose expected accepted tokens, rate + rate**2 +
        ... + rate**k, exceed their cost by the most; none worth it: one every PROBE_STEPS steps,
        so the rate can recover when the text turns repetitive. `rate`: this draft's own
        acceptance rate where something says more than the request's (a long matched context)."""
        rate = self.rate if rate is None else rate
        k, best, gain, chance = 0, 0.0, 0.0, 1.0
        for i in range(1, self.limit + 1):
            chance *= rate
            gain += chance
            value = gain - first_price - (i - 1) * next_price
            if value > best:
                k, best = i, value
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
    """A forward's seconds as a + b * rows + c * verifying (the requests verifying a draft), fitted
    by exponentially weighted least squares over steps of decodes and verifications (a prefill
    chunk costs by its context, not its rows). `c` holds what a draft costs beyond its rows: the
    row-by-row verification, and on a CPU the switch from a matrix-vector to a matrix-matrix
    product when a lone decode gets a second row. Where the steps do not pin them down (no step
    has verified a draft yet), b and c lean on priors stated as shares of a: two pseudo-observations
    of weight PRIOR_WEIGHT that, unlike the steps, never decay, so the fit is never singular."""

    def __init__(self) -> None:
        self._xx = [[0.0] * 3 for _ in range(3)]  # the steps' weighted sums
        self._xy = [0.0] * 3
        self._prior = [[0.0] * 3 for _ in range(3)]  # b - share * a = 0, c - share * a = 0
        for column, share in ((1, PRIOR_ROW_SHARE), (2, PRIOR_VERIFY_SHARE)):
            x = [-share, 0.0, 0.0]
            x[column] = 1.0
            for i in range(3):
                for j in range(3):
                    self._prior[i][j] += PRIOR_WEIGHT * x[i] * x[j]

    def observe(self, rows: int, verifying: int, seconds: float) -> None:
        x = [1.0, float(rows), float(verifying)]
        for i in range(3):
            self._xy[i] = COST_DECAY * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = COST_DECAY * self._xx[i][j] + x[i] * x[j]

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c), solving the normal equations (Gaussian elimination with pivoting)."""
        m = [
            [d + p for d, p in zip(data, prior)] + [y]
            for data, prior, y in zip(self._xx, self._prior, self._xy)
        ]
        tiny = 1e-12 * max(abs(v) for row in m for v in row[:3])
        for col in range(3):
            pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
            m[col], m[pivot] = m[pivot], m[col]
            if abs(m[col][col]) <= tiny:  # no step observed yet: the priors' shares of a = 1
                return 1.0, PRIOR_ROW_SHARE, PRIOR_VERIFY_SHARE
            for r in range(3):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [v - f * w for v, w in zip(m[r], m[col])]
        a, b, c = (m[i][3] / m[i][i] for i in range(3))
        return a, b, c

    def prices(self, rows: int, tokens: int) -> tuple[float, float]:
        """What a request's first drafted token and each further one cost, in tokens of output,
        for a step of `rows` rows that yields `tokens` tokens: their time over the step's."""
        a, b, c = self.coefficients()
        step = a + b * rows
        if step <= 0:
            return math.inf, math.inf
        b, c = max(b, 0.0), max(c, 0.0)
        return (b + c) * tokens / step, b * tokens / step
