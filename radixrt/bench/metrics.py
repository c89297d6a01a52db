"""The four serving metrics, computed from per-request timestamps: TTFT, TPOT / ITL, throughput and goodput."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTrace:
    """What one request did, seen from the client: times are `time.monotonic()` seconds."""

    sent: float  # when the client sent it (an open loop's scheduled arrival)
    # arrival of each streamed piece with tokens
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each piece
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    forward_passes: int = 0
    error: str | None = None
    tag: str = ""  # a workload's label for the request ("short", "long", "turn-1", ...)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        """Queueing + prefill until the first token reached the client."""
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.output_tokens < 2 or self.done is None:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Gaps between successive pieces of the stream (a piece may hold several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.05

    def met(self, trace: RequestTrace) -> bool:
        return (
            trace.error is None
            and trace.ttft is not None
            and trace.ttft <= self.ttft_s
            and (trace.tpot is None or trace.tpot <= self.tpot_s)
        )


@dataclass
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float
    std: float = math.nan  # population standard deviation, as vLLM's std_*_ms

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(*[math.nan] * 5)
        return cls(
            statistics.fmean(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
            statistics.pstdev(values),
        )


@dataclass
class Summary:
    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    output_throughput: float  # tokens/s
    request_throughput: float  # requests/s
    goodput: float  # requests/s that met the SLO
    slo_attainment: float  # share of requests that met the SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    forward_passes_per_request: float
    # one stream's decode speed: tokens after the first over the time they took, mean of requests
    stream_tok_s: float = math.nan
    input_tokens: int = 0  # prompt tokens of the requests that completed


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(traces: list[RequestTrace], duration_s: float, slo: SLO) -> Summary:
    """Aggregate the traces of one run that took `duration_s` seconds of wall time."""
    ok = [t for t in traces if t.error is None]
    tokens = sum(t.output_tokens for t in ok)
    met = sum(slo.met(t) for t in traces)
    return Summary(
        requests=len(traces),
        errors=len(traces) - len(ok),
        duration_s=duration_s,
        output_tokens=tokens,
        output_throughput=tokens / duration_s,
        request_throughput=len(ok) / duration_s,
        goodput=met / duration_s,
        slo_attainment=met / max(len(traces), 1),
        ttft=Distribution.of([t.ttft for t in ok if t.ttft is not None]),
        tpot=Distribution.of([t.tpot for t in ok if t.tpot is not None]),
        itl=Distribution.of([gap for t in ok for gap in t.itls()]),
        e2e=Distribution.of([t.done - t.sent for t in ok if t.done is not None]),
        forward_passes_per_request=statistics.fmean([t.forward_passes for t in ok])
        if ok
        else math.nan,
        stream_tok_s=statistics.fmean([1 / t.tpot for t in ok if t.tpot])
        if any(t.tpot for t in ok)
        else math.nan,
        input_tokens=sum(t.prompt_tokens for t in ok),
    )
