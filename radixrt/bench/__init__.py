"""Serving benchmarks: workloads, load generators, the four metrics, peers and plots."""

from radixrt.bench.runner import add_bench_args, run_bench

__all__ = ["add_bench_args", "run_bench"]
