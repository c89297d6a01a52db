"""The decode step as the step suites measure it (`--workload lora`, `decode-step`, `quant-step`,
`family-step-times`): a batch of requests with private prompts added to an in-process `Scheduler`,
stepped until every one of them decodes (admitted, one token to compute), then `step()`s timed
while the batch stays whole. No sockets: the step is what is measured.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine (torch) loads only when a suite runs
    from radixrt.engine.request import Req, RequestScope
    from radixrt.engine.scheduler import Scheduler

MARGIN = 8  # new tokens beyond what admission and the timed steps take


@dataclass(frozen=True, order=True)
class StepTime:
    """A decode step's median over timed steps: wall seconds, and the CPU seconds of the
    process's threads (on a machine shared with other work, the steadier measure of what a
    step costs). Ordered by wall time: `min` of several is the least disturbed."""

    wall_s: float
    cpu_s: float

    @property
    def wall_ms(self) -> float:
        return self.wall_s * 1e3


def private_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from 100 to 40,000 (a vocabulary's common
    range), seeded: the same on every call, nothing shared between them but by chance."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40_000) for _ in range(length)] for _ in range(count)]


def new_tokens_for(batch: int, steps: int) -> int:
    """The output length that keeps a batch of `batch` whole through admission (a request may
    start decoding while the last is still prefilled, one a step at worst) and `steps` steps
    after it: what a pool sized for the batch must hold beyond the prompts."""
    return batch + steps + MARGIN


def start_decoding(
    scheduler: Scheduler,
    prompts: Sequence[list[int]],
    steps: int,
    scopes: Sequence[RequestScope] | None = None,
) -> list[Req]:
    """Add one greedy request per prompt (`scopes[i]`, e.g. a LoRA adapter, for the i-th),
    each able to decode `steps` steps after the last is admitted, and step until every one of
    them is running with one token to compute. Returns the requests."""
    from radixrt.engine.request import DEFAULT_SCOPE
    from radixrt.sampling_params import SamplingParams

    params = SamplingParams.from_dict(
        {
            "max_new_tokens": new_tokens_for(len(prompts), steps),
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    reqs = [
        scheduler.make_request(f"step-{i}", p, params, scope=scopes[i] if scopes else DEFAULT_SCOPE)
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    while not _all_decoding(scheduler, reqs):
        scheduler.step()
    return reqs


def time_steps(scheduler: Scheduler, reqs: list[Req], steps: int) -> StepTime:
    """The median of `steps` timed `step()`s; an AssertionError unless every one of `reqs`
    (started by `start_decoding`) decodes through all of them."""
    assert _all_decoding(scheduler, reqs), "the batch is not decoding whole"
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        scheduler.step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    assert _all_decoding(scheduler, reqs), "a request finished while timed"
    return StepTime(statistics.median(wall), statistics.median(cpu))


def release(scheduler: Scheduler, reqs: list[Req]) -> None:
    """Abort `reqs` and empty the cache: the scheduler is as it was before `start_decoding`."""
    for req in reqs:
        scheduler.abort(req.rid)
    scheduler.flush_cache()


def _all_decoding(scheduler: Scheduler, reqs: list[Req]) -> bool:
    running = {id(r) for r in scheduler.running if r.tokens_to_compute == 1}
    return all(id(r) in running and not r.finished for r in reqs)
