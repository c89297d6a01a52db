"""`--workload weight-update-time`: weight updates of `--model` served by `rt.Engine` (docs/rl.md),
as a trainer sees them, under each `--systems` variant (radixrt; e.g. radixrt-int8):
`update_weights_from_disk` of the checkpoint folder, and `update_weights_from_tensor` of its
state_dict in this process (written to shared memory, loaded by the runtime), each the median of
`--repeats` (3), from the call to its answer, with nothing in flight. Into
`weight-update-time.json`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.variants import VARIANTS

if TYPE_CHECKING:
    import torch

POOL_TOKENS = 4096


@dataclass(frozen=True)
class WeightUpdate:
    """One variant's median update times (seconds) and the weight version after them."""

    system: str
    from_disk_s: float
    from_tensor_s: float
    weight_version: Any


@register("weight-update-time")
def run_weight_update_time(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.executor.model_loader import resolve_model_path

    config = run.config
    folder = resolve_model_path(config.model)
    state = _state_dict(folder)
    size_mib = sum(t.nbytes for t in state.values()) / 2**20
    repeats = config.repeats or 3
    results = [
        _updates(run, folder, state, system, repeats)
        for system in config.systems_for("weight-update-time")
    ]
    for r in results:
        print(
            f"{folder.name} ({size_mib:.0f} MiB as stored), {r.system}: from disk "
            f"{r.from_disk_s:.2f} s, from tensors {r.from_tensor_s:.2f} s (median of {repeats}; "
            f"weight_version now {r.weight_version})"
        )
    run.write(
        "weight-update-time",
        {
            "workload": "weight-update-time",
            "stored_mib": size_mib,
            "repeats": repeats,
            "results": [asdict(r) for r in results],
        },
    )
    return {}


def _state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def _updates(
    run: BenchRun, folder: Path, state: dict[str, torch.Tensor], system: str, repeats: int
) -> WeightUpdate:
    import radixrt as rt

    server: dict[str, Any] = {
        "max_total_tokens": run.config.max_total_tokens or POOL_TOKENS,
        "log_level": "warning",
        **VARIANTS[system],
    }
    engine = rt.Engine(model=str(folder), **server)
    try:
        disk = median_seconds(lambda: engine.update_weights_from_disk(str(folder)), repeats)
        tensor = median_seconds(lambda: engine.update_weights_from_tensor(state), repeats)
        return WeightUpdate(system, disk, tensor, engine.get_weight_version())
    finally:
        engine.shutdown()


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
