"""Tensor parallelism over real rank processes on gloo: the same greedy tokens as transformers,
logits as tp_size=1's, no process left behind however the group ends."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import radixrt as rt
from radixrt.client.launcher import free_port
from radixrt.client.transport import ConnectionLostError
from radixrt.distributed.sharding import shard_heads, split_range

from helpers import hf_greedy, launch_runtime, shared_prefix_prompts
from ownership import assert_all_free
from timeouts import REPLY_TIMEOUT_S

MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


# ---- the arithmetic of shards ---------------------------------------------------------------
def test_heads_split_by_gqa_group():
    # 3 KV heads over 2 ranks (the default model): whole groups, 2 and 1
    assert [tuple(shard_heads(9, 3, 2, r)) for r in range(2)] == [(0, 6, 0, 2), (6, 9, 2, 3)]
    # more ranks than KV heads: each KV head replicated, its queries split
    assert [tuple(shard_heads(8, 2, 4, r)) for r in range(4)] == [
        (0, 2, 0, 1),
        (2, 4, 0, 1),
        (4, 6, 1, 2),
        (6, 8, 1, 2),
    ]
    with pytest.raises(ValueError, match="cannot split"):
        shard_heads(9, 3, 4, 0)
    for n, size in [(49152, 2), (1536, 3), (7, 4)]:
        ranges = [split_range(n, size, r) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


# ---- real ranks -------------------------------------------------------------------------------
def _ranks_of(server: psutil.Process) -> list[psutil.Process]:
    """The rank processes a server started (not multiprocessing's resource tracker)."""
    return [p for p in server.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=seconds)
    return alive


def _engine(model_dir, **overrides) -> rt.Engine:
    return rt.Engine(
        model=str(model_dir), log_level="warning", **{"timeout": REPLY_TIMEOUT_S, **overrides}
    )


def _outputs(engine, prompts, **extra) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params={**GREEDY, **extra})


def _run_against(folder, prompts, expected, **overrides) -> tuple[dict, list[dict]]:
    """Cold then warm, equal to `expected`; invariants, and every slot free after a flush.
    Returns the stats and the warm run's outputs (with each token's logprob)."""
    with _engine(folder, tp_size=2, **overrides) as engine:
        for attempt in ("cold", "warm"):
            outs = _outputs(engine, prompts, return_logprob=True)
            got = [o["output_ids"] for o in outs]
            bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
            assert not bad, f"{attempt} run differs from transformers on prompts {bad}"
        stats = engine.stats()
        engine.check_invariants()
        assert engine.flush_cache()
        assert_all_free(engine.memory_snapshot())
    return stats, outs


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir):
    from transformers import AutoTokenizer

    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(tiny_model_dir))
    return tiny_model_dir, prompts, hf_greedy(tiny_model_dir, prompts, MAX_NEW)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"chunked_prefill_size": 5, "max_prefill_tokens": 24},
        {"max_total_tokens": 96, "max_running_requests": 8, "page_size": 4},
    ],
    ids=["default", "tiny-chunks", "tiny-pool-pages"],
)
def test_tiny_model_over_two_ranks_matches_transformers(tiny_case, overrides):
    folder, prompts, expected = tiny_case
    stats, _ = _run_against(folder, prompts, expected, **overrides)
    assert stats["tp_size"] == 2
    if "max_total_tokens" in overrides:
        assert stats["num_preemptions"] > 0


def test_default_model_over_two_ranks_matches_transformers_and_tp1_logits(default_model_dir):
    """The default model has 3 KV heads: rank 0 holds two groups, rank 1 one. Greedy tokens
    equal transformers'; every chosen token's logprob is within 1e-4 of tp_size=1's."""
    from transformers import AutoTokenizer

    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(default_model_dir), 6)
    expected = hf_greedy(default_model_dir, prompts, MAX_NEW)
    _, outs = _run_against(default_model_dir, prompts, expected, chunked_prefill_size=16)
    with _engine(default_model_dir, tp_size=1) as engine:
        alone = _outputs(engine, prompts, return_logprob=True)
    logprobs = [
        torch.tensor([lp for o in run for lp, _ in o["meta_info"]["output_token_logprobs"]])
        for run in (alone, outs)
    ]
    assert torch.allclose(logprobs[0], logprobs[1], atol=1e-4, rtol=0)


def test_qwen2_qkv_bias_over_two_ranks(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, folder / name)
    prompts = shared_prefix_prompts(AutoTokenizer.from_pretrained(folder), 6)
    _run_against(folder, prompts, hf_greedy(folder, prompts, MAX_NEW))


def test_two_nodes_on_loopback_give_the_same_output(tiny_case):
    folder, prompts, expected = tiny_case
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", str(folder), "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixrt",
            "serve",
            *common,
            "--node-rank",
            "1",
            "--log-level",
            "warning",
        ]
    )
    try:
        with launch_runtime(folder, tp_size=2, nnodes=2, dist_init_addr=addr) as runtime:
            got = [o["output_ids"] for o in _outputs(runtime, prompts)]
            assert got == expected
        assert node1.wait(timeout=30) == 0  # rank 0's shutdown ends the other node too
    finally:
        if node1.poll() is None:
            node1.kill()


def test_shutdown_and_killed_ranks_leave_no_process(tiny_case):
    folder, prompts, _ = tiny_case
    with _engine(folder, tp_size=2) as engine:
        _outputs(engine, prompts[:2])
        server = psutil.Process(engine._proc.pid)
        ranks = server.children(recursive=True)
        assert _ranks_of(server), "rank 1 runs in a process of its own"
    assert not _wait_gone([server, *ranks], 15), "shutdown left a rank behind"

    # the others notice within seconds; clients get errors: a lost rank 1 is said to the client
    # (worker_lost) well within 10 s; a lost rank 0 says nothing more, so its client times out
    for victim, timeout in (("rank 1", 10), ("rank 0", 3)):
        engine = _engine(folder, tp_size=2, timeout=timeout)
        server = psutil.Process(engine._proc.pid)
        rank1, children = _ranks_of(server), server.children(recursive=True)
        (rank1[0] if victim == "rank 1" else server).send_signal(signal.SIGKILL)
        start = time.monotonic()
        error = ConnectionLostError if victim == "rank 1" else TimeoutError
        with pytest.raises(error):
            _outputs(engine, prompts[:1])
        assert time.monotonic() - start < 30
        assert not _wait_gone([server, *children], 15), f"killing {victim} left a process behind"
        engine.shutdown()
