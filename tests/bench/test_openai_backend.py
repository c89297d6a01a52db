"""`radixrt bench --backend openai --base-url URL`: the ShareGPT loader on the shipped file, and
the bench measuring the tiny runtime's own HTTP gateway from the outside, as it would any
OpenAI-compatible server, with vLLM's flat result keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixrt.bench.datasets import MIN_TOKENS, load_sharegpt, sharegpt
from radixrt.bench.workloads import WorkloadConfig
from radixrt.cli import main

SHAREGPT = Path(__file__).resolve().parents[1] / "data" / "sharegpt_small.json"
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
