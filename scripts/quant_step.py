"""Time a decode step of a model at batch sizes, with float32, int8 and int4 weights, in one
run (one configuration loaded at a time), and print the ratios against float32 and int8.

    .venv/bin/python scripts/quant_step.py --model-shape tinyllama-1.1b --batch 1 32
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from tqdm import tqdm

from radixrt.bench.shapes import SHAPES, prepare
from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.sampling_params import SamplingParams

CONTEXT = 64  # tokens of each request's private prompt


def step_ms(model: str, quantization: str | None, batch: int, steps: int) -> float:
    """Best of two timed runs of `steps` decode steps with `batch` requests running."""
    new_tokens = 2 * steps + 8
    scheduler = Scheduler.from_server_args(
        ServerArgs(
            model=model,
            quantization=quantization,
            max_total_tokens=batch * (CONTEXT + new_tokens) + 64,
            max_running_requests=batch,
            chunked_prefill_size=batch * CONTEXT,
        )
    )
    rng = random.Random(0)
    params = SamplingParams.from_dict(
        {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    )
    for i in range(batch):
        ids = [rng.randrange(100, 40_000) for _ in range(CONTEXT)]
        scheduler.add_request(scheduler.make_request(f"r{i}", ids, params))
    while any(r.tokens_to_compute > 1 for r in scheduler.running) or scheduler.waiting:
        scheduler.step()
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(steps):
            scheduler.step()
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    assert len(scheduler.running) == batch, "a request finished while timed"
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--model-shape", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quantization", nargs="+", default=["float32", "int8", "int4"])
    args = parser.parse_args()
    model = str(prepare(args.model_shape).folder) if args.model_shape else args.model
    times: dict[tuple[str, int], float] = {}
    for q in tqdm(args.quantization, desc="configurations"):
        for batch in args.batch:
            times[q, batch] = step_ms(model, None if q == "float32" else q, batch, args.steps)
            gc.collect()
    for batch in args.batch:
        row = [f"{q} {times[q, batch]:.1f} ms" for q in args.quantization]
        ratios = [
            f"{a}/{b} {times[b, batch] / times[a, batch]:.2f}x"
            for a, b in (("int4", "int8"), ("int4", "float32"), ("int8", "float32"))
            if (a, batch) in times and (b, batch) in times
        ]
        print(f"batch {batch}: " + ", ".join(row) + "; speed " + ", ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
