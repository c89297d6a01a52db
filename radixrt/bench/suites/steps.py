"""The decode step of an in-process `Scheduler` on `--model`, as `radixrt.bench.decode_step`
measures it (a batch of private prompts all decoding, `--steps` steps timed, the best of
`--repeats` medians):

- `--workload decode-step`: at each of `--batches` (32) and `--contexts` (512,2048 tokens, each
  request its own, nothing shared), decode attention reading K/V in place in the pool against
  gathering them, alternated on one scheduler (`--steps` 5, `--repeats` 2), into
  `decode-step.json`;
- `--workload quant-step`: float32, int8 and int4 weights at each of `--batches` (1,32), one
  configuration loaded at a time, 64-token prompts (`--steps` 3, `--repeats` 2), and the ratios
  of each pair, into `quant-step.json`.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from radixrt.bench.decode_step import (
    StepTime,
    new_tokens_for,
    private_prompts,
    release,
    start_decoding,
    time_steps,
)
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

if TYPE_CHECKING:  # the engine (torch) loads only when a suite runs
    from radixrt.engine.scheduler import Scheduler

REPEATS = 2
QUANT_CONTEXT = 64  # tokens of each request's private prompt in quant-step
QUANTIZATIONS = ("float32", "int8", "int4")
QUANT_RATIOS = (("int4", "int8"), ("int4", "float32"), ("int8", "float32"))


@dataclass(frozen=True)
class AttentionRead:
    """decode-step at one batch and context: the step with K/V read in place and gathered."""

    batch: int
    context: int
    in_place: StepTime
    gathered: StepTime

    @property
    def speedup(self) -> float:
        """The gathered step's wall time over the in-place one's."""
        return self.gathered.wall_s / self.in_place.wall_s


@dataclass(frozen=True)
class QuantStep:
    """quant-step: the step of one weight format at one batch."""

    quantization: str
    batch: int
    step: StepTime


def _scheduler(run: BenchRun, batch: int, context: int, steps: int, **args: Any) -> Scheduler:
    """An in-process scheduler on `--model` with room for `batch` requests of `context` prompt
    tokens decoding through admission and `steps` more steps; `args` are more `ServerArgs`."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    server_args = ServerArgs(
        model=run.config.model,
        dtype=run.config.dtype,
        max_total_tokens=batch * (context + new_tokens_for(batch, steps)) + 64,
        max_running_requests=batch,
        log_level="warning",
        **args,
    )
    return Scheduler.from_server_args(server_args)


@register("decode-step")
def run_decode_step(run: BenchRun) -> dict[str, list[RunResult]]:
    config = run.config
    steps, repeats = config.steps or 5, config.repeats or REPEATS
    rows = [
        _in_place_against_gathered(run, batch, context, steps, repeats)
        for batch in config.batch_sizes or [32]
        for context in config.context_lens or [512, 2048]
    ]
    for r in rows:
        print(
            f"batch {r.batch}, private context {r.context}: decode step in place "
            f"{r.in_place.wall_ms:.0f} ms, gathered {r.gathered.wall_ms:.0f} ms "
            f"({r.speedup:.2f}x)",
            flush=True,
        )
    run.write(
        "decode-step",
        {
            "workload": "decode-step",
            "steps": steps,
            "repeats": repeats,
            "results": [{**asdict(r), "speedup": r.speedup} for r in rows],
        },
    )
    return {}


def _in_place_against_gathered(
    run: BenchRun, batch: int, context: int, steps: int, repeats: int
) -> AttentionRead:
    """Both reads on one scheduler, alternated `repeats` times (drift cancels), a warm step
    before each timed run; the best of each."""
    from radixrt.attention.torch_backend import TorchAttentionBackend

    total = 2 * repeats * (steps + 1)
    scheduler = _scheduler(
        run,
        batch,
        context,
        total,
        max_prefill_tokens=context,
        chunked_prefill_size=context,
    )
    backend = scheduler.runner.attn_backend
    assert isinstance(backend, TorchAttentionBackend), "decode-step times the torch backend"
    reqs = start_decoding(scheduler, private_prompts(batch, context, run.config.seed), total)
    times: dict[bool, list[StepTime]] = {True: [], False: []}
    for in_place in (True, False) * repeats:
        backend.in_place = in_place
        scheduler.step()  # warm
        times[in_place].append(time_steps(scheduler, reqs, steps))
    release(scheduler, reqs)
    scheduler.close()
    return AttentionRead(batch, context, min(times[True]), min(times[False]))


@register("quant-step")
def run_quant_step(run: BenchRun) -> dict[str, list[RunResult]]:
    from tqdm import tqdm

    config = run.config
    steps, repeats = config.steps or 3, config.repeats or REPEATS
    batches = config.batch_sizes or [1, 32]
    rows = [
        _quant_step(run, q, batch, steps, repeats)
        for q in tqdm(QUANTIZATIONS, desc="configurations")
        for batch in batches
    ]
    ratios = {
        b: _quant_ratios({r.quantization: r.step for r in rows if r.batch == b}) for b in batches
    }
    for batch in batches:
        times = ", ".join(
            f"{r.quantization} {r.step.wall_ms:.1f} ms" for r in rows if r.batch == batch
        )
        speeds = ", ".join(f"{pair} {ratio:.2f}x" for pair, ratio in ratios[batch].items())
        print(f"batch {batch}: {times}; speed {speeds}", flush=True)
    run.write(
        "quant-step",
        {
            "workload": "quant-step",
            "context": QUANT_CONTEXT,
            "steps": steps,
            "repeats": repeats,
            "results": [asdict(r) for r in rows],
            "speed_ratios": ratios,
        },
    )
    return {}


def _quant_step(
    run: BenchRun, quantization: str, batch: int, steps: int, repeats: int
) -> QuantStep:
    """The best of `repeats` timed runs of `steps` steps (after a warm one), `batch` requests
    decoding, on a scheduler of its own (closed, and its memory collected, before the next
    loads)."""
    total = repeats * steps + 1
    scheduler = _scheduler(
        run,
        batch,
        QUANT_CONTEXT,
        total,
        quantization=None if quantization == "float32" else quantization,
        chunked_prefill_size=batch * QUANT_CONTEXT,
    )
    prompts = private_prompts(batch, QUANT_CONTEXT, run.config.seed)
    reqs = start_decoding(scheduler, prompts, total)
    scheduler.step()  # warm
    best = min(time_steps(scheduler, reqs, steps) for _ in range(repeats))
    release(scheduler, reqs)
    scheduler.close()
    gc.collect()
    return QuantStep(quantization, batch, best)


def _quant_ratios(steps: dict[str, StepTime]) -> dict[str, float]:
    """How many times faster the first of each pair of QUANT_RATIOS steps than the second."""
    return {f"{a}/{b}": steps[b].wall_s / steps[a].wall_s for a, b in QUANT_RATIOS}
