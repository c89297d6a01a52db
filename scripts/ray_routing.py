"""Prefix-cache hit rate and throughput of radixrt replicas behind Ray Serve LLM, routed by
`RadixAffinityRouter` and by Ray's default (power of two choices), on one multi-prefix workload.

The workload: `--prefixes` system prompts of about `--prefix-words` words, each asked
`--questions` short questions, sent one at a time in rounds (every prefix once per round), so
the default router's choice is between two idle replicas each time (a coin toss, or a turn each
when its queue-length cache lags; the odd prefix count keeps the turns from pinning a prefix to
one replica). Each replica's pool holds about half the prefixes (`--max-total-tokens`), so what
matters is which replica a prefix's requests reach: always the same one (affinity), or either
(the default). The hit rate is the cached share of
prompt tokens, from each response's `usage.prompt_tokens_details.cached_tokens`.

    python scripts/ray_routing.py [--model PATH] [--prefixes 13] [--questions 6]

tests/integrations/test_ray_serve.py runs the same functions on the tiny random model.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from radixrt.integrations.ray import RadixrtServer, build_openai_app

AFFINITY_ROUTER = "radixrt.integrations.ray:RadixAffinityRouter"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@dataclass(frozen=True)
class Workload:
    prefixes: int = 13
    questions: int = 6
    prefix_words: int = 90
    max_tokens: int = 4
    seed: int = 0

    def messages(self) -> list[list[dict[str, str]]]:
        """The requests in the order they are sent: round q asks question q under each prefix."""
        rng = random.Random(self.seed)
        systems = [
            f"System prompt {p}: " + " ".join(rng.choices(WORDS, k=self.prefix_words))
            for p in range(self.prefixes)
        ]
        return [
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: what comes after {WORDS[q]}?"},
            ]
            for q in range(self.questions)
            for system in systems
        ]


@dataclass(frozen=True)
class Result:
    router: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def line(self) -> str:
        return (
            f"{self.router:>9}: hit rate {self.hit_rate:.1%} ({self.cached_tokens}/"
            f"{self.prompt_tokens} prompt tokens cached), {self.requests} requests in "
            f"{self.seconds:.1f} s ({self.requests_per_s:.1f} req/s)"
        )


def llm_config(model: str, *, affinity: bool, replicas: int = 2, **engine_kwargs: Any) -> Any:
    """Two (`replicas`) radixrt replicas of `model`, served as "model", routed by
    `RadixAffinityRouter` (`affinity`) or by Ray's default."""
    from ray.serve.llm import LLMConfig

    deployment: dict[str, Any] = {
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": 0.5},
        "health_check_period_s": 5,
    }
    if affinity:
        deployment["request_router_config"] = {"request_router_class": AFFINITY_ROUTER}
    return LLMConfig(
        model_loading_config={"model_id": "model", "model_source": model},
        server_cls=RadixrtServer,
        engine_kwargs=engine_kwargs,
        deployment_config=deployment,
    )


def run_workload(client: Any, workload: Workload, router: str) -> Result:
    """Send the workload one request at a time through `client` (an `openai.OpenAI`)."""
    prompt = cached = 0
    start = time.perf_counter()
    requests = workload.messages()
    for messages in requests:
        reply = client.chat.completions.create(
            model="model", messages=messages, max_tokens=workload.max_tokens, temperature=0
        )
        prompt += reply.usage.prompt_tokens
        cached += reply.usage.prompt_tokens_details.cached_tokens
    return Result(router, len(requests), prompt, cached, time.perf_counter() - start)


def main() -> None:
    import openai
    import ray
    from ray import serve

    from radixrt.client.launcher import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefixes", type=int, default=13)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=90)
    parser.add_argument("--max-total-tokens", type=int, default=1350)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args()
    workload = Workload(args.prefixes, args.questions, args.prefix_words)
    port = free_port()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for router, affinity in (("default", False), ("affinity", True)):
            config = llm_config(
                args.model, affinity=affinity, max_total_tokens=args.max_total_tokens
            )
            serve.run(build_openai_app({"llm_configs": [config]}), name="radixrt")
            print(run_workload(client, workload, router).line(), flush=True)
            serve.delete("radixrt")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
