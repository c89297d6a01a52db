"""`--backend http` (any workload but agent-tools): multi-turn chat through the OpenAI API
against the same conversations over ZeroMQ (`radixrt.bench.http_bench`), into `http.json`."""

from __future__ import annotations

from radixrt.bench.http_bench import HttpBenchConfig, run_http_bench
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult


@register("http")
def run_http_chat(run: BenchRun) -> dict[str, list[RunResult]]:
    """The bench's model, pool and seed; `--turns` and `--num-requests` (conversations, 10 when
    unset) shape the chats, whose replies keep `HttpBenchConfig`'s own length."""
    config = run.config
    chats = HttpBenchConfig(
        model=config.model,
        dtype=config.dtype,
        seed=config.seed,
        max_total_tokens=config.max_total_tokens,
        num_turns=config.turns,
        num_conversations=config.num_requests or HttpBenchConfig.num_conversations,
    )
    run.write("http", {"workload": "multi-turn over HTTP", **run_http_bench(chats)})
    return {}
