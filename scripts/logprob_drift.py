"""How far greedy logprobs move today with how a request is served (issue 43, item 2).

The same prompts are decoded greedily, with each output token's logprob, by an in-process
scheduler under several conditions; each condition is compared with the prompt served alone on
a cold cache: how many outputs differ in a token, and the largest |logprob difference| over the
tokens before any difference.

    python scripts/logprob_drift.py [--model default] [--prompts 12] [--new-tokens 16]

Conditions: `batched` (every prompt in one batch), `cached` (after a request that shares the
prompt's first half), `chunked` (`--chunked-prefill-size 16`), `int8` (cold and warm compared
within int8 serving, since int8 differs from float32 by design).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.sampling_params import SamplingParams


@dataclass(frozen=True)
class Output:
    """One request's greedy tokens and their logprobs."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Drift:
    """One condition against its reference: outputs whose tokens differ, and the largest
    |logprob difference| over the tokens both still agree on."""

    condition: str
    differing_outputs: int
    max_abs_logprob_delta: float


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of 24 to 120 token ids from the default vocabulary's common range."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randrange(24, 121))] for _ in range(n)]


def run(scheduler: Scheduler, batches: list[list[list[int]]], new_tokens: int) -> list[Output]:
    """Each batch of prompts served together, one batch after another; the outputs in order."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    outputs = []
    for b, batch in enumerate(batches):
        reqs = [
            scheduler.make_request(
                f"{b}-{i}", p, SamplingParams.from_dict({**params, "return_logprob": True})
            )
            for i, p in enumerate(batch)
        ]
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
        outs += run(scheduler, [[p]], new_tokens)
    return outs


def cached(scheduler: Scheduler, ps: list[list[int]], new_tokens: int) -> list[Output]:
    """Each prompt after a one-token request on its first half (the prefix then comes from
    the tree)."""
    outs = []
    for p in ps:
        scheduler.flush_cache()
        run(scheduler, [[p[: len(p) // 2]]], 1)
        outs += run(scheduler, [[p]], new_tokens)
    return outs


def drift(condition: str, got: list[Output], reference: list[Output]) -> Drift:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--output", default="logprob_drift.json")
    a = ap.parse_args()
    ps = prompts(a.prompts)

    def scheduler(**settings) -> Scheduler:
        return Scheduler.from_server_args(
            ServerArgs(model=a.model, max_total_tokens=8192, **settings)
        )

    base = scheduler()
    reference = alone(base, ps, a.new_tokens)
    results = [
        drift("batched", run(base, [ps], a.new_tokens), reference),
        drift("cached", cached(base, ps, a.new_tokens), reference),
        drift("chunked", alone(scheduler(chunked_prefill_size=16), ps, a.new_tokens), reference),
    ]
    int8 = scheduler(quantization="int8")
    int8_alone = alone(int8, ps, a.new_tokens)
    results += [
        drift("int8 batched", run(int8, [ps], a.new_tokens), int8_alone),
        drift("int8 cached", cached(int8, ps, a.new_tokens), int8_alone),
    ]
    print(f"{'condition':<14} {'outputs that differ':>20} {'max |Δ logprob|':>16}")
    for d in results:
        print(
            f"{d.condition:<14} {d.differing_outputs:>14} / {len(ps):<3} {d.max_abs_logprob_delta:>16.3g}"
        )
    with open(a.output, "w") as f:
        json.dump([d.__dict__ for d in results], f, indent=2)


if __name__ == "__main__":
    main()
