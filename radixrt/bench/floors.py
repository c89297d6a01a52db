"""How close a run came to the machine's limits, measured in the same run.

Two rates are measured just before the runs: the GEMM rate (a float matmul as large as a
prefill's) and the read bandwidth (summing a tensor far larger than the caches). A run's floors
follow from what its forwards computed (the runtime's counters and the model's weight counts):
- compute floor: 2 FLOPs per weight per token through the decoder layers, the output
  projection's for each row whose logits were read, and attention's for each (query, key) pair
  attended, all at the GEMM rate;
- bandwidth floor: every forward step reads all the weights at least once, at the read bandwidth.
A share is floor time / the run's time: 1.0 would be at the limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GEMM_SHAPE = (512, 2048, 2048)  # m, k, n: a prefill chunk through a wide layer
READ_BYTES = 512 << 20  # far above the last-level cache
REPEATS = 5


@dataclass(frozen=True)
class MachineRates:
    gemm_flops: float  # float32 multiply-adds x 2 per second
    read_bandwidth: float  # bytes per second

    @classmethod
    def measure(cls) -> MachineRates:
        """Best of a few repeats of each, on this process's threads (as the runtime uses them)."""
        import torch

        m, k, n = GEMM_SHAPE
        a, b = torch.randn(m, k), torch.randn(k, n)
        data = torch.ones(READ_BYTES // 4)
        gemm = _best(lambda: torch.mm(a, b))
        read = _best(lambda: data.sum())
        return cls(2 * m * k * n / gemm, READ_BYTES / read)


@dataclass(frozen=True)
class Floors:
    compute_s: float
    bandwidth_s: float
    compute_share: float  # compute floor / the run's duration
    bandwidth_share: float

    @classmethod
    def of(
        cls,
        rates: MachineRates,
        weights: dict[str, Any],
        counters: dict[str, float],
        duration: float,
    ) -> Floors:
        """`weights`: the runtime's model_info["weights"]; `counters`: the change over the run of
        its forward_steps, forward_tokens, attention_pairs and logit_rows."""
        flops = (
            2
            * (
                weights["layer_params"] * counters["forward_tokens"]
                + weights["head_params"] * counters["logit_rows"]
            )
            + weights["attention_flops_per_pair"] * counters["attention_pairs"]
        )
        compute = flops / rates.gemm_flops
        bandwidth = counters["forward_steps"] * weights["weight_bytes"] / rates.read_bandwidth
        duration = max(duration, 1e-9)
        return cls(compute, bandwidth, compute / duration, bandwidth / duration)


def _best(run: Callable[[], object]) -> float:
    run()  # warm up: allocation, thread pool
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)
