"""Time weight updates of a model served by `rt.Engine` (docs/rl.md), as a trainer sees them:
`update_weights_from_disk` of a checkpoint folder, and `update_weights_from_tensor` of a
state_dict in this process (written to shared memory, loaded by the runtime), each the median of
a few, from the call to its answer, with nothing in flight.

    .venv/bin/python scripts/weight_update_time.py --model default --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from safetensors.torch import load_file

import radixrt as rt
from radixrt.executor.model_loader import resolve_model_path


def seconds(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    folder = resolve_model_path(args.model)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    size = sum(t.nbytes for t in state.values()) / 2**20
    with rt.Engine(
        model=str(folder), max_total_tokens=4096, quantization=args.quantization,
        log_level="warning",
    ) as engine:  # fmt: skip
        disk = seconds(lambda: engine.update_weights_from_disk(str(folder)), args.repeat)
        tensor = seconds(lambda: engine.update_weights_from_tensor(state), args.repeat)
        version = engine.get_weight_version()
    print(
        f"{folder.name} ({size:.0f} MiB as stored, {args.quantization or 'float'} serving): "
        f"from disk {disk:.2f} s, from tensors {tensor:.2f} s (median of {args.repeat}; "
        f"weight_version now {version})"
    )


if __name__ == "__main__":
    main()
