"""Serving benchmarks: workloads, load generators, the four metrics, peers and plots."""

from radixrt.bench.config import BenchConfig
from radixrt.bench.runner import run_bench

__all__ = ["BenchConfig", "run_bench"]
