"""Falcon-H1 (`FalconH1ForCausalLM`) beyond its hybrid checkpoints (which
tests/executor/test_hybrid_families.py serves, with and without the Mamba mixer's gated norm):
every layer attends and keeps a Mamba state (a KV-pool layer and a stateful mixer each); every
prompt position is scored as transformers scores it, the logits multiplied by
`lm_head_multiplier` (which greedy tokens alone would not see); what the shared layers cannot
hold is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from radixrt.models import model_class
from radixrt.models.falcon_h1 import FalconH1ForCausalLM
from radixrt.models.layers import Mamba2Mixer

from helpers import TINY, assert_prompt_logprobs_match, random_checkpoint

# two layers, the Mamba mixer 96 wide (8 heads of 12, 2 groups), normed after the gate; the
# logits' multiplier other than 1
SHAPE = dict(
    TINY,
    mamba_d_ssm=96,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_chunk_size=8,
    mamba_rms_norm=True,
    mamba_norm_before_gate=False,
    lm_head_multiplier=0.3,
    key_multiplier=0.5,
    ssm_multipliers=[0.8, 1.25, 0.9, 1.1, 0.5],
    max_position_embeddings=512,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def falcon(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("falcon-h1")
    return random_checkpoint(folder, tiny_model_dir, "falcon_h1", SHAPE, seed=11)


def test_every_layer_attends_and_keeps_a_state():
    """Each layer's parallel mixer writes a KV-pool layer of its own and holds a Mamba mixer."""
    config = AutoConfig.for_model("falcon_h1", **SHAPE)
    assert model_class(config) is FalconH1ForCausalLM
    with torch.device("meta"):
        model = FalconH1ForCausalLM(config, 64)
    layers = config.num_hidden_layers
    assert model.kv_layers == layers and model.kv_layer_of == {i: i for i in range(layers)}
    assert model.recurrent and len(model.stateful) == layers
    assert all(isinstance(m, Mamba2Mixer) and m.gate_norm == "after_gate" for m in model.stateful)


def test_scores_prompts_as_transformers(falcon):
    """Every prompt position's log-probability of the next token equals transformers'."""
    ids = list(range(700, 745))
    assert_prompt_logprobs_match(falcon, ids)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention_bias", True, "attention_bias is set"),
        ("mlp_bias", True, "mlp_bias is set"),
        ("mamba_d_conv", 1, "mamba_d_conv is 1"),
        ("mamba_n_groups", 3, "not a multiple of mamba_n_groups"),
    ],
)
def test_what_the_layers_cannot_hold_is_refused(field, value, message):
    config = AutoConfig.for_model("falcon_h1", **SHAPE)
    setattr(config, field, value)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        FalconH1ForCausalLM(config, 64)
