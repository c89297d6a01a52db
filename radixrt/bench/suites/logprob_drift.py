"""`--workload logprob-drift`: how far greedy logprobs move with how a request is served.

`--num-requests` (12) prompts of 24 to 120 token ids (seeded by `--seed`) are decoded greedily,
`--max-new-tokens` (16) tokens with each one's logprob, by an in-process scheduler on `--model`
under several conditions; each condition is compared with the prompt served alone on a cold
cache: how many outputs differ in a token, and the largest |logprob difference| over the tokens
before any difference (and the one where they part). Conditions: `batched` (every prompt in one
batch), `cached` (after a request that shares the prompt's first half), `chunked`
(`--chunked-prefill-size 16`), and `int8 batched` and `int8 cached`, compared within int8
serving, since int8 differs from float32 by design. Into `logprob-drift.json`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

if TYPE_CHECKING:  # the engine (torch) loads only when the suite runs
    from radixrt.engine.scheduler import Scheduler

DEFAULT_PROMPTS = 12
DEFAULT_NEW_TOKENS = 16
POOL_TOKENS = 8192


@dataclass(frozen=True)
class Output:
    """One request's greedy tokens and their logprobs."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Drift:
    """One condition against its reference: outputs whose tokens differ, and the largest
    |logprob difference| over the tokens both still agree on (and the first they do not)."""

    condition: str
    differing_outputs: int
    max_abs_logprob_delta: float


@register("logprob-drift")
def run_logprob_drift(run: BenchRun) -> dict[str, list[RunResult]]:
    config = run.config
    ps = prompts(config.num_requests or DEFAULT_PROMPTS, config.seed)
    new = config.max_new_tokens or DEFAULT_NEW_TOKENS
    base = _scheduler(run)
    reference = alone(base, ps, new)
    results = [
        drift("batched", serve(base, [ps], new), reference),
        drift("cached", cached(base, ps, new), reference),
        drift("chunked", alone(_scheduler(run, chunked_prefill_size=16), ps, new), reference),
    ]
    int8 = _scheduler(run, quantization="int8")
    int8_alone = alone(int8, ps, new)
    results += [
        drift("int8 batched", serve(int8, [ps], new), int8_alone),
        drift("int8 cached", cached(int8, ps, new), int8_alone),
    ]
    print(f"{'condition':<14} {'outputs that differ':>20} {'max |Δ logprob|':>16}")
    for d in results:
        print(
            f"{d.condition:<14} {d.differing_outputs:>14} / {len(ps):<3} "
            f"{d.max_abs_logprob_delta:>16.3g}"
        )
    run.write(
        "logprob-drift",
        {
            "workload": "logprob-drift",
            "prompts": len(ps),
            "new_tokens": new,
            "results": [asdict(d) for d in results],
        },
    )
    return {}


def _scheduler(run: BenchRun, **settings: Any) -> Scheduler:
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    args = ServerArgs(
        model=run.config.model,
        dtype=run.config.dtype,
        max_total_tokens=run.config.max_total_tokens or POOL_TOKENS,
        log_level="warning",
        **settings,
    )
    return Scheduler.from_server_args(args)


def prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 24 to 120 token ids from a vocabulary's common range."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randrange(24, 121))] for _ in range(n)]


def serve(scheduler: Scheduler, batches: list[list[list[int]]], new_tokens: int) -> list[Output]:
    """Each batch of prompts served together, one batch after another; the outputs in order."""
    from radixrt.sampling_params import SamplingParams

    params = SamplingParams.from_dict(
        {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    )
    outputs = []
    for b, batch in enumerate(batches):
        reqs = [scheduler.make_request(f"{b}-{i}", p, params) for i, p in enumerate(batch)]
        for req in reqs:
            scheduler.add_request(req)
        while scheduler.has_work():
            scheduler.step()
        outputs += [Output(r.output_ids, [lp for lp, _ in r.output_token_logprobs]) for r in reqs]
    return outputs


def alone(scheduler: Scheduler, ps: list[list[int]], new_tokens: int) -> list[Output]:
    """Each prompt by itself on a cold cache."""
    outs = []
    for p in ps:
        scheduler.flush_cache()
        outs += serve(scheduler, [[p]], new_tokens)
    return outs


def cached(scheduler: Scheduler, ps: list[list[int]], new_tokens: int) -> list[Output]:
    """Each prompt after a one-token request on its first half (the prefix then comes from
    the tree)."""
    outs = []
    for p in ps:
        scheduler.flush_cache()
        serve(scheduler, [[p[: len(p) // 2]]], 1)
        outs += serve(scheduler, [[p]], new_tokens)
    return outs


def drift(condition: str, got: list[Output], reference: list[Output]) -> Drift:
    """How far `got` strays from `reference`, output by output."""
    differing, delta = 0, 0.0
    for g, r in zip(got, reference):
        same = 0
        while same < len(r.tokens) and same < len(g.tokens) and g.tokens[same] == r.tokens[same]:
            same += 1
        differing += same < len(r.tokens)
        # the token where they part is still compared: its logprob was computed on one history
        upto = min(same + 1, len(r.logprobs), len(g.logprobs))
        delta = max([delta, *(abs(a - b) for a, b in zip(g.logprobs[:upto], r.logprobs[:upto]))])
    return Drift(condition, differing, delta)
