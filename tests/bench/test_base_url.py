"""`radixrt bench --backend openai --base-url URL`: the ShareGPT loader on the shipped file, and
the bench measuring the tiny runtime's own HTTP gateway from the outside, as it would any
OpenAI-compatible server, with vLLM's flat result keys."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixrt.bench.datasets import MIN_TOKENS, load_sharegpt, sharegpt
from radixrt.bench.load import Load, run_load
from radixrt.bench.metrics import SLO
from radixrt.bench.results import result_of
from radixrt.bench.workloads import Session, Turn, WorkloadConfig
from radixrt.cli import main

from helpers import DATA

SHAREGPT = DATA / "sharegpt_small.json"
VLLM_KEYS = (
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
)


def test_sharegpt_loader_reads_json_and_json_lines(tmp_path):
    """Each conversation that opens human → gpt is one exchange (a system-first one is not);
    JSON Lines holds the same; a file of something else is a ValueError naming it."""
    exchanges = load_sharegpt(SHAREGPT)
    records = json.loads(SHAREGPT.read_text())
    assert len(exchanges) == len(records) - 1
    assert exchanges[0].prompt == records[0]["conversations"][0]["value"]
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert load_sharegpt(lines) == exchanges
    bad = tmp_path / "bad.json"
    bad.write_text('[{"messages": []}]')
    with pytest.raises(ValueError, match="bad.json"):
        load_sharegpt(bad)


def test_sharegpt_sessions_ask_for_the_replys_length(default_model_dir):
    """A session per exchange long enough to send, asking for as many tokens as its reply had;
    seeded; `--fixed-output-len` asks for --max-new-tokens instead."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    cfg = WorkloadConfig(num_requests=100, dataset_path=str(SHAREGPT), seed=3)
    sessions = sharegpt(tokenizer, cfg)
    assert sessions == sharegpt(tokenizer, cfg) and len(sessions) == 10  # "Ok" is too short
    replies = {e.prompt: e.reply for e in load_sharegpt(SHAREGPT)}
    for session in sessions:
        (turn,) = session.turns
        want = len(tokenizer.encode(replies[turn.text], add_special_tokens=False))
        assert turn.params["max_new_tokens"] == want >= MIN_TOKENS and turn.params["ignore_eos"]
    fixed = WorkloadConfig(num_requests=3, dataset_path=str(SHAREGPT), fixed_output=True)
    assert [s.turns[0].params["max_new_tokens"] for s in sharegpt(tokenizer, fixed)] == [64] * 3


def _bench(tmp_path: Path, runtime, model_dir: Path, *argv: str) -> dict:
    out = tmp_path / argv[argv.index("--workload") + 1]
    main(
        ["bench", "--backend", "openai", "--base-url", runtime.http_url, "--model", str(model_dir)]
        + [*argv, "--output-dir", str(out)]
    )
    (result,) = out.glob("*.json")
    return json.loads(result.read_text())


def test_bench_measures_a_server_through_its_base_url(tiny_runtime, tiny_model_dir, tmp_path):
    """ShareGPT under a concurrency cap and random prompts at a request rate, sent to the tiny
    runtime's gateway over /v1/completions: every request completes with the lengths asked for,
    and the file has vLLM's flat keys beside the bench's own figures."""
    result = _bench(
        tmp_path,
        tiny_runtime,
        tiny_model_dir,
        *("--workload", "sharegpt", "--dataset-path", str(SHAREGPT)),
        *("--num-requests", "4", "--max-concurrency", "2"),
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    asked = [s.turns[0].params["max_new_tokens"] for s in sharegpt(tokenizer, _shape(4))]
    assert set(VLLM_KEYS) <= set(result) and result["max_concurrency"] == 2
    assert result["completed"] == 4 and result["total_output_tokens"] == sum(asked)
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    (run,) = result["results"]
    assert run["completed"] == 4 and run["summary"]["output_tokens"] == sum(asked)

    result = _bench(
        tmp_path,
        tiny_runtime,
        tiny_model_dir,
        *("--workload", "random", "--random-input-len", "24", "--random-output-len", "6"),
        *("--num-requests", "3", "--request-rate", "20"),
    )
    assert result["completed"] == 3 and result["total_output_tokens"] == 18
    assert result["total_input_tokens"] >= 3 * 24 and result["request_rate"] == 20
    assert (
        result["mean_itl_ms"] > 0 and result["total_token_throughput"] > result["output_throughput"]
    )


def _shape(num_requests: int) -> WorkloadConfig:
    return WorkloadConfig(num_requests=num_requests, dataset_path=str(SHAREGPT))


class _SlowTarget:
    """A server stand-in for the load generator alone: each request streams two pieces 50 ms
    apart, and the most requests it ever held at once is recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.most = 0

    def generate(self, prompt: str, params: dict, stream: bool = True):
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        for _ in range(2):
            time.sleep(0.05)
            yield {"finished": False, "token_ids": [0]}
        with self.lock:
            self.in_flight -= 1
        meta = {"prompt_tokens": 3, "cached_tokens": 0, "finish_reason": {"type": "length"}}
        yield {"finished": True, "text": "ab", "output_ids": [0, 0], "meta_info": meta}


def test_max_concurrency_caps_requests_in_flight_and_times_count_from_sending():
    """Six sessions all at once under --max-concurrency 2: never more than two in flight, and
    a waiting session's times count from when it is sent, once a place is free (vLLM's
    semantics), not from the start; vLLM's keys in ms over the same traces."""
    sessions = [Session([Turn("hi", {"max_new_tokens": 2})]) for _ in range(6)]
    target = _SlowTarget()
    load = Load(max_concurrency=2)
    traces, duration = run_load(target, sessions, load, render=str)
    assert target.most == 2 and len(traces) == 6 and duration >= 0.3
    sent = sorted(t.sent for t in traces)  # the last two wait for two requests of 0.1 s each
    assert sent[-1] - sent[0] >= 0.2
    result = result_of("stub", load, traces, duration, SLO())
    flat = result.vllm_metrics()
    assert flat["completed"] == 6 and flat["max_concurrency"] == 2 and flat["request_rate"] == "inf"
    assert flat["total_input_tokens"] == 18 and flat["total_output_tokens"] == 12
    assert flat["median_ttft_ms"] == pytest.approx(result.summary.ttft.p50 * 1000)
    assert flat["mean_e2el_ms"] >= flat["mean_ttft_ms"] > 0
