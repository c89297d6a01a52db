"""Granite 4 (`GraniteMoeHybridForCausalLM`) beyond its hybrid checkpoints (which
tests/executor/test_hybrid_families.py serves, dense and with experts): its router's weights
are transformers' to the bit; a model whose layers are all attention (Granite-4.0-micro's
shape: no state per request, rotary positions) answers as transformers does, its scalars
(embeddings, residuals, attention scores, logits) applied, and scores every prompt position as
transformers does; one whose stacked experts tensor parallelism would split is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from radixrt.config import ServerArgs
from radixrt.distributed.group import TPGroup
from radixrt.engine.scheduler import Scheduler
from radixrt.models import model_class
from radixrt.models.moe import route

from helpers import TINY, assert_prompt_logprobs_match, hf_greedy, random_checkpoint, run_in_process

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
# Granite-4.0-micro's shape, tiny: every layer attention, the shared MLP alone, rotary
MICRO = dict(
    TINY,
    num_hidden_layers=3,
    layer_types=["attention"] * 3,
    mamba_n_heads=8,  # no Mamba layer, but the config checks its shape
    shared_intermediate_size=96,
    num_local_experts=0,
    position_embedding_type="rope",
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.5,
    max_position_embeddings=512,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def micro(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("granite4-micro")
    return random_checkpoint(folder, tiny_model_dir, "granitemoehybrid", MICRO, seed=7)


def test_routing_is_granites_top_k_then_softmax():
    """The top k of the logits (not of their softmax), softmaxed among themselves: the experts
    and weights of transformers' router, bit for bit."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridTopKRouter,
    )

    config = AutoConfig.for_model(
        "granitemoehybrid",
        hidden_size=32,
        mamba_n_heads=8,
        num_local_experts=7,
        num_experts_per_tok=3,
    )
    router = GraniteMoeHybridTopKRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    logits, weights, experts = router(torch.randn(40, 32))
    got = route(logits, 3, True, top_k_first=True)
    assert torch.equal(got.experts, experts)
    assert torch.equal(got.weights, weights)


def test_an_all_attention_granite_matches_transformers(micro):
    """Greedy tokens equal transformers', cold then warm (cached), prefilled in chunks over
    pages; no state slots (no Mamba layer)."""
    shared = list(range(300, 320))
    prompts = [shared + [501, 502], shared + [601, 602, 603], list(range(700, 745))]
    expected = hf_greedy(micro, prompts, GREEDY["max_new_tokens"])
    scheduler = Scheduler.from_server_args(
        ServerArgs(
            model=str(micro),
            attention_backend="torch",
            max_total_tokens=1024,
            chunked_prefill_size=16,
            page_size=4,
        )
    )
    assert not scheduler.runner.model.recurrent
    got = run_in_process(scheduler, [prompts, prompts], GREEDY)
    assert got == [*expected, *expected]
    assert scheduler.stats()["cached_prompt_tokens_total"] > 0
    scheduler.check_invariants()


def test_an_all_attention_granite_scores_prompts_as_transformers(micro):
    """Every prompt position's log-probability of the next token: the logits divided by
    `logits_scaling` as transformers divides them (greedy tokens alone would not see it)."""
    ids = list(range(700, 745))
    assert_prompt_logprobs_match(micro, ids)


def test_experts_split_by_tensor_parallelism_are_refused(micro):
    """The stacked experts are read an expert at a time, whole: two ranks splitting each
    expert are refused by name; two holding half the experts each (--ep-size) are not."""
    config = AutoConfig.from_pretrained(micro)
    config.num_local_experts, config.num_experts_per_tok = 4, 2
    with torch.device("meta"):
        with pytest.raises(ValueError, match="experts are stacked in one tensor"):
            model_class(config)(config, 64, TPGroup(size=2, rank=0))
        model = model_class(config)(config, 64, TPGroup(size=2, rank=0, expert_parallel=True))
    assert model.expert_ids == (0, 2)
