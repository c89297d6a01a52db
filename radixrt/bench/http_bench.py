"""`radixrt bench --backend http`: multi-turn chat through the `openai` client and the HTTP gateway,
against the same conversations over ZeroMQ (`RuntimeEndpoint`), on one runtime in one run.

Every turn resends the whole history, so all but the newest user message should come from the
radix cache. Greedy decoding makes both paths produce the same conversations.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from radixrt.bench.load import REPLY_TIMEOUT_S, stream_into
from radixrt.bench.metrics import RequestTrace, percentile
from radixrt.client.launcher import Runtime
from radixrt.server.http.schemas import render_chat

TOPICS = (
    "river",
    "stone",
    "cloud",
    "engine",
    "garden",
    "window",
    "market",
    "winter",
    "signal",
    "forest",
    "harbor",
    "copper",
    "lantern",
    "meadow",
    "thunder",
    "canyon",
    "orbit",
    "glacier",
    "ember",
    "quartz",
)
SYSTEM = (
    "You are a concise assistant for a field research team. Answer in one or two sentences, "
    "name concrete places and materials, and never repeat the question."
)

Turn = Callable[
    [list[dict[str, str]]], tuple[str, float, tuple[int, int, int]]
]  # -> text, ttft, usage


@dataclass
class HttpBenchConfig:
    model: str = "default"
    num_conversations: int = 10
    num_turns: int = 6
    max_new_tokens: int = 32
    dtype: str = "auto"
    max_total_tokens: int | None = 65536
    seed: int = 0


@dataclass
class PassResult:
    path: str
    duration_s: float
    output_tokens: int
    output_throughput: float  # tokens/s
    cache_hit_rate: float  # cached prompt tokens / prompt tokens, over this pass
    ttft_turn1_p50_s: float
    ttft_turn1_p99_s: float
    ttft_later_p50_s: float
    ttft_later_p99_s: float


def run_http_bench(config: HttpBenchConfig) -> dict[str, Any]:
    """Run both paths. Prints a table and returns `{"config", "zmq", "http",
    "throughput_overhead"}`."""
    conversations = _conversations(config)
    runtime = Runtime(
        model=config.model,
        dtype=config.dtype,
        max_total_tokens=config.max_total_tokens,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    )
    with runtime:
        import openai

        client = openai.OpenAI(base_url=f"{runtime.http_url}/v1", api_key="none")
        paths = {
            "zmq": _zmq_turn(runtime, config.max_new_tokens),
            "http": _http_turn(client, runtime.model_info["model"], config.max_new_tokens),
        }
        results = {}
        for name, turn in paths.items():
            # warm-up (the gateway loads its tokenizer)
            turn([{"role": "user", "content": "Hello"}])
            runtime.flush_cache()
            results[name] = _run_pass(name, conversations, turn)
    overhead = 1 - results["http"].output_throughput / results["zmq"].output_throughput
    _print_table(list(results.values()), overhead)
    return {
        "config": dataclasses.asdict(config),
        **{k: dataclasses.asdict(v) for k, v in results.items()},
        "throughput_overhead": overhead,
    }


def _conversations(config: HttpBenchConfig) -> list[list[str]]:
    rng = random.Random(config.seed)
    return [
        [
            f"Question {t + 1}: what about the {' '.join(rng.choice(TOPICS) for _ in range(12))}?"
            for t in range(config.num_turns)
        ]
        for _ in range(config.num_conversations)
    ]


def _run_pass(name: str, conversations: list[list[str]], turn: Turn) -> PassResult:
    """All conversations at once (one thread each), each turn after the previous answer."""
    with tqdm(total=sum(map(len, conversations)), desc=f"chat over {name}") as bar:

        def converse(questions: list[str]) -> list[tuple[int, float, tuple[int, int, int]]]:
            messages, records = [{"role": "system", "content": SYSTEM}], []
            for index, question in enumerate(questions):
                messages.append({"role": "user", "content": question})
                text, ttft, usage = turn(messages)
                messages.append({"role": "assistant", "content": text})
                records.append((index, ttft, usage))
                bar.update()
            return records

        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(conversations)) as pool:
            records = [r for records in pool.map(converse, conversations) for r in records]
        duration = time.monotonic() - start
    first = [percentile([ttft for index, ttft, _ in records if index == 0], q) for q in (50, 99)]
    later = [percentile([ttft for index, ttft, _ in records if index > 0], q) for q in (50, 99)]
    prompt, cached, output = (sum(usage[i] for _, _, usage in records) for i in range(3))
    return PassResult(
        name,
        duration,
        output,
        output / duration,
        cached / max(prompt, 1),
        *map(float, [*first, *later]),
    )


def _zmq_turn(runtime: Runtime, max_new_tokens: int) -> Turn:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}

    def turn(messages: list[dict[str, str]]) -> tuple[str, float, tuple[int, int, int]]:
        trace = RequestTrace(sent=time.monotonic())
        text = stream_into(
            trace, runtime.generate(render_chat(runtime.tokenizer, messages), params, stream=True)
        )
        if trace.error or trace.done is None:
            raise RuntimeError(trace.error or "the stream ended without a final reply")
        assert trace.ttft is not None, "a finished reply has at least one token"
        return text, trace.ttft, (trace.prompt_tokens, trace.cached_tokens, trace.output_tokens)

    return turn


def _http_turn(client: Any, model: str, max_new_tokens: int) -> Turn:
    """Turns through `client`, an `openai.OpenAI` (Any: its message parameters are TypedDicts,
    the bench's messages the plain maps `render_chat` takes too)."""

    def turn(messages: list[dict[str, str]]) -> tuple[str, float, tuple[int, int, int]]:
        start, ttft, parts, usage = time.monotonic(), None, [], None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if ttft is None and (content or chunk.choices and chunk.choices[0].finish_reason):
                ttft = time.monotonic() - start
            parts.append(content or "")
            if chunk.usage is not None:
                usage = (
                    chunk.usage.prompt_tokens,
                    chunk.usage.prompt_tokens_details.cached_tokens,
                    chunk.usage.completion_tokens,
                )
        assert ttft is not None and usage is not None, "the stream ended without a finish"
        return "".join(parts), ttft, usage

    return turn


def _print_table(results: list[PassResult], overhead: float) -> None:
    print(
        f"{'path':<6} {'tok/s':>8} {'hit rate':>9} {'TTFT t1 p50':>12} {'t1 p99':>8} {'later p50':>10} "
        f"{'later p99':>10}"
    )
    for r in results:
        print(
            f"{r.path:<6} {r.output_throughput:>8.1f} {r.cache_hit_rate:>9.2f} {r.ttft_turn1_p50_s:>11.3f}s "
            f"{r.ttft_turn1_p99_s:>7.3f}s {r.ttft_later_p50_s:>9.3f}s {r.ttft_later_p99_s:>9.3f}s"
        )
    print(f"HTTP throughput overhead against ZeroMQ: {overhead:.1%}")
