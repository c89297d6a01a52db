"""Time a decode step of the default model at a batch of requests with long private contexts,
with decode attention reading K/V in place in the pool and gathering them, in one run.

    .venv/bin/python scripts/decode_step.py --batch 32 --context 512 2048
"""

from __future__ import annotations

import argparse
import random
import time

from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.sampling_params import SamplingParams


def decode_ms(scheduler: Scheduler, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    # requests decode while the later ones prefill (one a step): enough new tokens for that and
    # every timed step, so the batch stays whole; few enough that admission reserves little room
    new_tokens = args.batch + 4 * (args.steps + 1) + 8
    params = SamplingParams.from_dict(
        {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    )
    for context in args.context:
        scheduler = Scheduler.from_server_args(
            ServerArgs(
                max_total_tokens=args.batch * (context + new_tokens) + 64,
                max_prefill_tokens=context,
                chunked_prefill_size=context,
                max_running_requests=args.batch,
            )
        )
        for i in range(args.batch):  # private contexts: nothing shared, not even the first token
            ids = [rng.randrange(100, 40_000) for _ in range(context)]
            scheduler.add_request(scheduler.make_request(f"r{i}", ids, params))
        while any(r.tokens_to_compute > 1 for r in scheduler.running) or scheduler.waiting:
            scheduler.step()
        assert len(scheduler.running) == args.batch
        backend = scheduler.runner.attn_backend
        timings = {}
        for in_place in (True, False, True, False):  # alternated, best of two: drift cancels
            backend.in_place = in_place
            scheduler.step()  # warm
            timings.setdefault(in_place, []).append(decode_ms(scheduler, args.steps))
        assert len(scheduler.running) == args.batch, "a request finished while timed"
        best = {k: min(v) for k, v in timings.items()}
        print(
            f"batch {args.batch}, private context {context}: decode step in place "
            f"{best[True]:.0f} ms, gathered {best[False]:.0f} ms ({best[False] / best[True]:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
