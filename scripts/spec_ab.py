"""Speculative decoding on against off at batch 1, interleaved in one process.

`radixrt bench` runs one system after the other, and this machine's speed drifts 20-30% between
runs, which swamps a 5% question such as "does speculation cost anything on text with nothing to
copy". Here both schedulers live in one process and take turns: each round runs the same fresh
requests (a new workload seed per round) one after another through each. Reported per round and
overall: one stream's decode speed (output tokens after the first over their time).

    python scripts/spec_ab.py --workload agent-loop [--temperature 1] [--rounds 3] [--requests 8]
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from radixrt.bench.workloads import REQUEST_WORKLOADS, WorkloadConfig
from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.executor.model_loader import resolve_model_path
from radixrt.sampling_params import SamplingParams


def decode_speed(scheduler: Scheduler, prompts: list[tuple[list[int], dict]], tag: str) -> float:
    """Output tokens after each request's first, over the time they took (requests in turn)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="agent-loop", choices=sorted(REQUEST_WORKLOADS))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))

    def render(session) -> list[int]:
        text = session.turns[0].text
        if session.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        return tokenizer.encode(text, add_special_tokens=False)

    schedulers = {
        name: Scheduler.from_server_args(
            ServerArgs(speculative_algorithm=spec, max_total_tokens=16384)
        )
        for name, spec in (("off", None), ("on", "ngram"))
    }
    speeds: dict[str, list[float]] = {name: [] for name in schedulers}
    for round_ in range(args.rounds):
        cfg = WorkloadConfig(
            num_requests=args.requests,
            max_new_tokens=args.max_new_tokens,
            fixed_output=True,
            seed=round_,
            temperature=args.temperature,
        )
        sessions = REQUEST_WORKLOADS[args.workload](tokenizer, cfg)
        prompts = [(render(s), s.turns[0].params) for s in sessions]
        for name, scheduler in schedulers.items():
            speeds[name].append(decode_speed(scheduler, prompts, f"{round_}{name}"))
        print(f"round {round_}: off {speeds['off'][-1]:.1f} tok/s, on {speeds['on'][-1]:.1f} tok/s")
    ratio = sum(speeds["on"]) / sum(speeds["off"])
    accept = schedulers["on"].stats()["spec_accept_length"]
    print(
        f"{args.workload} (temperature {args.temperature}): one stream on/off {ratio:.2f}x, "
        f"{accept:.2f} tokens per verifying forward"
    )


if __name__ == "__main__":
    main()
