"""The table `radixrt bench` prints per workload: every system's result, a ratio over the
baseline, and each radixrt run over the faster llama.cpp peer under the same load."""

from __future__ import annotations

import math

from radixrt.bench.results import RunResult
from radixrt.bench.variants import LLAMA_PEERS


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_table(workload: str, results: list[RunResult], baseline: str | None) -> None:
    base = next((r for r in results if r.system == baseline), None)
    programs = any(r.load.startswith("run_batch") for r in results)
    # a select-only program generates nothing
    metric = "request_throughput" if programs else "output_throughput"
    head = (
        f"{'system':<28}{'load':<26}{'req/s':>7}{'tok/s':>8}{'goodput':>8}{'TTFT p50':>9}{'p99':>7}"
        f"{'TPOT p50':>9}{'ITL p99':>8}{'hit':>6}{'preempt':>8}{'fwd/req':>8}{'ratio':>7}"
    )
    print(
        f"\n{workload}" + (f" (ratio: {metric.replace('_', ' ')} over {baseline})" if base else "")
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.summary
        ratio = f"{getattr(s, metric) / getattr(base.summary, metric):.2f}x" if base else "-"
        print(
            f"{r.system:<28}{r.load[:25]:<26}{s.request_throughput:>7.2f}{s.output_throughput:>8.1f}"
            f"{s.goodput:>8.2f}{_fmt(s.ttft.p50):>8}s{_fmt(s.ttft.p99):>6}s{_fmt(s.tpot.p50 * 1e3, '.0f'):>7}ms"
            f"{_fmt(s.itl.p99 * 1e3, '.0f'):>6}ms{_fmt(r.cache_hit_rate):>6}{_fmt(r.num_preemptions, 'd'):>8}"
            f"{_fmt(s.forward_passes_per_request, '.1f'):>8}{ratio:>7}"
        )
        for tag, t in r.by_tag.items():
            print(
                f"  {tag:<48}{t.request_throughput:>7.2f}{t.output_throughput:>8.1f}{t.goodput:>8.2f}"
                f"{_fmt(t.ttft.p50):>8}s{_fmt(t.ttft.p99):>6}s{_fmt(t.tpot.p50 * 1e3, '.0f'):>7}ms"
                f"{_fmt(t.itl.p99 * 1e3, '.0f'):>6}ms"
            )
        if not programs:
            print(f"  one stream: {_fmt(s.stream_tok_s, '.1f')} tok/s after its first token")
        if r.spec_accept_length is not None:
            print(f"  speculation: {r.spec_accept_length:.2f} tokens per verifying forward")
        if r.rank_peak_rss_mb is not None:
            share = (
                ""
                if r.tp_collective_share is None
                else (f"collectives {100 * r.tp_collective_share:.1f}% of rank 0's step time; ")
            )
            peaks = ", ".join(f"{m:.0f}" for m in r.rank_peak_rss_mb)
            print(f"  processes: {share}peak resident memory {peaks} MB")
        if r.host_hit_tokens is not None:
            print(
                f"  host tier: {r.host_hit_tokens} prompt tokens loaded back, "
                f"{r.swapped_in_tokens} swapped in"
            )
        if r.mask_time_share is not None:
            print(f"  constraint masks: {100 * r.mask_time_share:.2f}% of step time")
        if r.floors is not None:
            f = r.floors
            print(
                f"  floors: compute {f.compute_s:.2f}s ({100 * f.compute_share:.0f}% reached), "
                f"weight reads {f.bandwidth_s:.2f}s ({100 * f.bandwidth_share:.0f}% reached)"
            )
    _print_against_llama(results, metric)


def _print_against_llama(results: list[RunResult], metric: str) -> None:
    """Each radixrt run over the faster of the llama.cpp peers under the same load."""
    for r in results:
        same_load = [
            p
            for p in results
            if p.system in LLAMA_PEERS
            and (p.request_rate, p.concurrency) == (r.request_rate, r.concurrency)
        ]
        if not r.system.startswith("radixrt") or not same_load:
            continue
        best = max(same_load, key=lambda p: getattr(p.summary, metric))
        ratio = getattr(r.summary, metric) / max(getattr(best.summary, metric), 1e-9)
        print(
            f"{r.system} ({r.load}) over the faster llama.cpp peer ({best.system}): "
            f"{ratio:.2f}x {metric.replace('_', ' ')}"
        )


def baseline_of(results: list[RunResult], systems: list[str]) -> str | None:
    """What the table's ratios are over: transformers when it ran, else the second system."""
    if any(r.system == "transformers" for r in results):
        return "transformers"
    return systems[1] if len(systems) > 1 else None
