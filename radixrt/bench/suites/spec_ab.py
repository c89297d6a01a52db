"""`--workload spec-ab`: speculative decoding on against off at batch 1, interleaved in one
process.

The request suites run one system after the other, and a shared machine's speed drifts 20-30%
between runs, which swamps a 5% question such as "does speculation cost anything on text with
nothing to copy". Here both schedulers (on `--model`; ngram speculation on, and off) live in one
process and take turns: each of `--rounds` (3) runs the same fresh requests, the first turns of
`--num-requests` (8) sessions of `--spec-workload` (a new workload seed each round, from
`--seed`; `--max-new-tokens` each, `--temperature`), one after another through each. Reported
per round and overall: one stream's decode speed (output tokens after the first over their
time), and the tokens per verifying forward. Into `spec-ab.json`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

if TYPE_CHECKING:  # the engine (torch) loads only when the suite runs
    from radixrt.engine.scheduler import Scheduler

DEFAULT_REQUESTS = 8
POOL_TOKENS = 16384
Prompt = tuple[list[int], dict[str, Any]]  # a request's token ids and its sampling params


@dataclass(frozen=True)
class SpecRound:
    """One round: one stream's decode speed (tokens a second) with speculation off and on."""

    round: int
    off_tok_s: float
    on_tok_s: float


@register("spec-ab")
def run_spec_ab(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    config = run.config
    schedulers = {
        side: Scheduler.from_server_args(
            ServerArgs(
                model=config.model,
                dtype=config.dtype,
                speculative_algorithm=spec,
                max_total_tokens=config.max_total_tokens or POOL_TOKENS,
                log_level="warning",
            )
        )
        for side, spec in (("off", None), ("on", "ngram"))
    }
    rounds = []
    for r in range(config.rounds or 3):
        prompts = _prompts(run, config.seed + r)
        off, on = (decode_speed(schedulers[s], prompts, f"{r}{s}") for s in ("off", "on"))
        rounds.append(SpecRound(r, off, on))
        print(f"round {r}: off {off:.1f} tok/s, on {on:.1f} tok/s", flush=True)
    ratio = sum(r.on_tok_s for r in rounds) / sum(r.off_tok_s for r in rounds)
    accept = float(schedulers["on"].stats()["spec_accept_length"])
    for scheduler in schedulers.values():
        scheduler.close()
    print(
        f"{config.spec_workload} (temperature {config.temperature}): one stream on/off "
        f"{ratio:.2f}x, {accept:.2f} tokens per verifying forward"
    )
    run.write(
        "spec-ab",
        {
            "workload": "spec-ab",
            "spec_workload": config.spec_workload,
            "on_over_off": ratio,
            "spec_accept_length": accept,
            "rounds": [asdict(r) for r in rounds],
        },
    )
    return {}


def _prompts(run: BenchRun, seed: int) -> list[Prompt]:
    """The first turn of each `--spec-workload` session made with `seed`, as token ids (a chat
    session's through the chat template), with its params."""
    from transformers import AutoTokenizer

    from radixrt.bench.workloads import REQUEST_WORKLOADS, WorkloadConfig
    from radixrt.executor.model_loader import resolve_model_path

    config = run.config
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    shape = WorkloadConfig(
        num_requests=config.num_requests or DEFAULT_REQUESTS,
        max_new_tokens=config.new_tokens,
        fixed_output=True,
        seed=seed,
        temperature=config.temperature,
    )
    prompts = []
    for session in REQUEST_WORKLOADS[config.spec_workload](tokenizer, shape):
        text = session.turns[0].text
        if session.chat:
            text = str(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
            )
        prompts.append((tokenizer.encode(text, add_special_tokens=False), session.turns[0].params))
    return prompts


def decode_speed(scheduler: Scheduler, prompts: list[Prompt], tag: str) -> float:
    """Output tokens after each request's first, over the time they took (requests in turn)."""
    from radixrt.sampling_params import SamplingParams

    seconds, tokens = 0.0, 0
    for i, (ids, params) in enumerate(prompts):
        req = scheduler.make_request(f"{tag}-{i}", ids, SamplingParams.from_dict(params))
        scheduler.add_request(req)
        while not req.output_ids:
            scheduler.step()
        start, first = time.perf_counter(), len(req.output_ids)
        while scheduler.has_work():
            scheduler.step()
        seconds += time.perf_counter() - start
        tokens += len(req.output_ids) - first
    return tokens / seconds
