"""Families whose layers carry a state per request besides their KV, each a tiny random
checkpoint made with transformers' own config class: LFM2 (short convolutions between attention
layers). Greedy tokens equal transformers' in float32, prompts batched together, prefilled in
chunks over pages, and again when the same prompts come back (served without prefix reuse: a
cached prefix holds no convolution state); what such a model cannot be served with is refused
at start by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.config import ServerArgs
from radixrt.distributed.group import TPGroup
from radixrt.engine.scheduler import Scheduler
from radixrt.models.lfm2 import Lfm2ForCausalLM

from helpers import TINY, hf_greedy, run_in_process

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LFM2 = dict(
    TINY,
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=3,
    block_multiple_of=32,
    max_position_embeddings=512,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("lfm2")
    config = AutoConfig.for_model("lfm2", **LFM2)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1: make their weights count
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(torch.randn_like(weight) * 0.2)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes((tiny_model_dir / file).read_bytes())
    return folder


def _prompts() -> list[list[int]]:
    """Two sharing a 20-token prefix, one of 5 tokens, one of 45 (three 16-token chunks)."""
    shared = list(range(300, 320))
    return [shared + [501, 502], shared + [601, 602, 603], shared[:5], list(range(700, 745))]


@pytest.mark.parametrize("pool", [1024, 96], ids=["roomy", "preempted"])
def test_lfm2_matches_transformers_batched_chunked_and_resent(lfm2, pool):
    """With a pool of 96 tokens the four requests (193 tokens in all) cannot run together:
    some are retracted and recomputed, their convolution states started again with them."""
    prompts = _prompts()
    expected = hf_greedy(lfm2, prompts, MAX_NEW)
    scheduler = Scheduler.from_server_args(
        ServerArgs(
            model=str(lfm2),
            attention_backend="torch",
            max_total_tokens=pool,
            chunked_prefill_size=16,
            page_size=4,
        )
    )
    assert scheduler.runner.model.recurrent and scheduler.runner.state_bytes > 0
    got = run_in_process(scheduler, [prompts, prompts], GREEDY)
    assert got[: len(prompts)] == expected, "first"
    assert got[len(prompts) :] == expected, "resent"
    stats = scheduler.stats()
    assert stats["cached_prompt_tokens_total"] == 0
    assert (stats["num_preemptions"] > 0) == (pool < 1024)
    scheduler.check_invariants()


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"speculative_algorithm": "ngram"}, "--speculative-algorithm: Lfm2ForCausalLM"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache: Lfm2ForCausalLM"),
        ({"enable_lora": True}, "Lfm2ForCausalLM declares no projections"),
    ],
)
def test_lfm2_refuses_what_its_state_cannot_follow(lfm2, flags, message):
    args = ServerArgs(model=str(lfm2), max_total_tokens=256, **flags)
    with pytest.raises(ValueError, match=message):
        Scheduler.from_server_args(args)


def test_lfm2_is_served_on_one_rank(lfm2):
    config = AutoConfig.from_pretrained(lfm2)
    with torch.device("meta"), pytest.raises(ValueError, match="one rank"):
        Lfm2ForCausalLM(config, 64, TPGroup(size=2, rank=0))
