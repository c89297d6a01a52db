"""`--workload ray-routing`: prefix-cache hit rate and throughput of two radixrt replicas of
`--model` behind Ray Serve LLM, routed by `RadixAffinityRouter` and by Ray's default (power of
two choices), on one multi-prefix workload (needs ray[serve,llm] and openai).

The workload (`Workload`): PREFIXES (13) system prompts of about PREFIX_WORDS (90) words, each
asked `--rounds` (6) short questions, sent one at a time in rounds (every prefix once per round),
so the default router's choice is between two idle replicas each time (a coin toss, or a turn
each when its queue-length cache lags; the odd prefix count keeps the turns from pinning a
prefix to one replica). Each replica's pool holds about half the prefixes (`--max-total-tokens`,
1350 when unset), so what matters is which replica a prefix's requests reach: always the same
one (affinity), or either (the default). The hit rate is the cached share of prompt tokens, from
each response's `usage.prompt_tokens_details.cached_tokens`. On a local Ray cluster of RAY_CPUS
CPUs. Into `ray-routing.json`. tests/integrations/test_ray_serve.py runs the same functions on
the tiny random model.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

AFFINITY_ROUTER = "radixrt.integrations.ray:RadixAffinityRouter"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
PREFIXES = 13
PREFIX_WORDS = 90
POOL_TOKENS = 1350
RAY_CPUS = 2


@dataclass(frozen=True)
class Workload:
    """`prefixes` system prompts of `prefix_words` words, `questions` questions to each, each
    answered in `max_tokens` tokens."""

    prefixes: int = PREFIXES
    questions: int = 6
    prefix_words: int = PREFIX_WORDS
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
    """One router's run of the workload: its prompt tokens, the cached ones, its time."""

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


def serve_app(llm: Any, name: str) -> str:
    """Run `llm` (an `llm_config`) as the Serve app `name` at the route /`name`; that route.
    Each router gets an app of its own name: Serve's proxy keeps a deployment's handle, and the
    request router the handle made, while the deployment's id stays in its route table, and a
    delete and a redeploy under one name between two of the proxy's polls leave it there, so the
    second app would be routed by the first's router (in CI, affinity runs at the default's hit
    rate)."""
    from ray import serve

    from radixrt.integrations.ray import build_openai_app

    serve.run(build_openai_app({"llm_configs": [llm]}), name=name, route_prefix=f"/{name}")
    return f"/{name}"


def llm_config(model: str, *, affinity: bool, replicas: int = 2, **engine_kwargs: Any) -> Any:
    """Two (`replicas`) radixrt replicas of `model`, served as "model", routed by
    `RadixAffinityRouter` (`affinity`) or by Ray's default."""
    from ray.serve.llm import LLMConfig

    from radixrt.integrations.ray import RadixrtServer

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


@register("ray-routing")
def run_ray_routing(run: BenchRun) -> dict[str, list[RunResult]]:
    import openai
    import ray
    from ray import serve

    from radixrt.client.launcher import free_port

    config = run.config
    workload = Workload(questions=config.rounds or Workload.questions, seed=config.seed)
    pool = config.max_total_tokens or POOL_TOKENS
    port = free_port()
    results = []
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for router, affinity in (("default", False), ("affinity", True)):
            llm = llm_config(config.model, affinity=affinity, max_total_tokens=pool)
            route = serve_app(llm, router)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}{route}/v1", api_key="-")
            results.append(run_workload(client, workload, router))
            print(results[-1].line(), flush=True)
            serve.delete(router)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    run.write(
        "ray-routing",
        {
            "workload": "ray-routing",
            "shape": asdict(workload),
            "max_total_tokens": pool,
            "results": [{**asdict(r), "hit_rate": r.hit_rate} for r in results],
        },
    )
    return {}
