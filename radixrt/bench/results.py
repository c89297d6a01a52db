"""One system's result under one load (`RunResult`), made from its request traces and the
server's counters over the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixrt.bench.floors import Floors, MachineRates
from radixrt.bench.load import Load
from radixrt.bench.metrics import SLO, RequestTrace, Summary, summarize

# the server's cumulative counters a run reads as differences (peak_used_tokens is read as is)
COUNTERS = (
    "num_preemptions",
    "evicted_tokens",
    "constraint_mask_time_s",
    "step_time_s",
    "forward_steps",
    "forward_tokens",
    "attention_pairs",
    "logit_rows",
    "spec_verifications",
    "spec_accepted_tokens",
    "host_hit_tokens",
    "swapped_in_tokens",
    "tp_collective_time_s",
)


@dataclass
class RunResult:
    system: str
    load: str
    request_rate: float | None
    concurrency: int | None
    summary: Summary
    cache_hit_rate: float | None = None  # cached prompt tokens / prompt tokens, over this run
    num_preemptions: int | None = None
    evicted_tokens: int | None = None
    # most KV slots in use at once (the cache is flushed before each load)
    peak_used_tokens: int | None = None
    mask_time_share: float | None = None  # constraint masks / step time
    # speculative decoding: tokens a request got per forward that verified its draft
    spec_accept_length: float | None = None
    tp_collective_share: float | None = None  # rank 0's collectives / its step time
    rank_peak_rss_mb: list[float] | None = None  # each rank process's peak resident memory
    host_hit_tokens: int | None = None  # prompt tokens loaded back from the host tier
    swapped_in_tokens: int | None = None  # retracted requests' tokens loaded back
    floors: Floors | None = None  # the run's compute and weight-read floors, and the shares reached
    by_tag: dict[str, Summary] = field(default_factory=dict)
    # long-prompt: every ITL gap of the short requests
    short_itls: list[float] = field(default_factory=list)
    max_concurrency: int | None = None  # the load's cap on requests in flight (or its clients)

    def vllm_metrics(self) -> dict[str, Any]:
        """This run's figures flat, under the key names of vLLM's serving benchmark result
        (`completed`, `mean_ttft_ms`, ...; latencies in ms, e2e as `*_e2el_ms`), so that what
        reads vLLM's JSON reads these; written beside the nested figures."""
        s = self.summary
        flat: dict[str, Any] = {
            "duration": s.duration_s,
            "completed": s.requests - s.errors,
            "failed": s.errors,
            "total_input_tokens": s.input_tokens,
            "total_output_tokens": s.output_tokens,
            "request_throughput": s.request_throughput,
            "request_goodput": s.goodput,
            "output_throughput": s.output_throughput,
            "total_token_throughput": (s.input_tokens + s.output_tokens) / s.duration_s,
            "request_rate": self.request_rate if self.request_rate is not None else "inf",
            "max_concurrency": self.max_concurrency,
        }
        for name, d in (("ttft", s.ttft), ("tpot", s.tpot), ("itl", s.itl), ("e2el", s.e2e)):
            for stat, value in (
                ("mean", d.mean),
                ("median", d.p50),
                ("std", d.std),
                ("p99", d.p99),
            ):
                flat[f"{stat}_{name}_ms"] = value * 1000
        return flat


@dataclass(frozen=True)
class ServerCounters:
    """What a radixrt run adds to its traces: the counters' change over the run, and the
    machine's rates and the model's weight counts its floors are computed from."""

    delta: dict[str, float]
    machine: MachineRates
    weights: dict[str, Any]


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """`COUNTERS`' change from one `stats()` to the next, and the peak KV use at the second."""
    delta = {k: after[k] - before[k] for k in COUNTERS}
    return {**delta, "peak_used_tokens": after["peak_used_tokens"]}


def result_of(
    system: str,
    load: Load,
    traces: list[RequestTrace],
    duration: float,
    slo: SLO,
    counters: ServerCounters | None = None,
) -> RunResult:
    """A run's summary, per tag too (and over a conversation's later turns); with `counters`
    (radixrt runs only), its cache, preemption, speculation and floor figures."""
    tags = sorted({t.tag for t in traces if t.tag})
    result = RunResult(
        system,
        load.describe(),
        load.request_rate,
        load.concurrency,
        summarize(traces, duration, slo),
        max_concurrency=load.max_concurrency or load.concurrency,
        by_tag={tag: summarize([t for t in traces if t.tag == tag], duration, slo) for tag in tags},
        short_itls=[gap for t in traces if t.tag == "short" for gap in t.itls()],
    )
    if len(tags) >= 2 and all(tag.startswith("turn-") for tag in tags):
        later = [t for t in traces if t.tag != "turn-1"]  # the turns that resend a history
        result.by_tag["later turns"] = summarize(later, duration, slo)
    if counters is not None:
        _add_counters(result, traces, duration, counters)
    return result


def _add_counters(
    result: RunResult, traces: list[RequestTrace], duration: float, counters: ServerCounters
) -> None:
    delta = counters.delta
    prompt = sum(t.prompt_tokens for t in traces)
    result.cache_hit_rate = sum(t.cached_tokens for t in traces) / max(prompt, 1)
    if delta["tp_collective_time_s"]:
        result.tp_collective_share = delta["tp_collective_time_s"] / max(delta["step_time_s"], 1e-9)
    if delta["host_hit_tokens"] or delta["swapped_in_tokens"]:
        result.host_hit_tokens = int(delta["host_hit_tokens"])
        result.swapped_in_tokens = int(delta["swapped_in_tokens"])
    result.num_preemptions = int(delta["num_preemptions"])
    result.evicted_tokens = int(delta["evicted_tokens"])
    result.peak_used_tokens = int(delta["peak_used_tokens"])
    result.floors = Floors.of(counters.machine, counters.weights, delta, duration)
    if delta["spec_verifications"]:
        result.spec_accept_length = 1 + delta["spec_accepted_tokens"] / delta["spec_verifications"]
    if delta["constraint_mask_time_s"]:
        result.mask_time_share = delta["constraint_mask_time_s"] / max(delta["step_time_s"], 1e-9)
