"""LFM2 (Liquid): a decoder whose layers mix either by attention (q/k norms per head) or by a
gated short convolution (`layers.ShortConv`, `conv` in `layer_types`), each followed by a SwiGLU
MLP whose width the config adjusts (`block_auto_adjust_ff_dim`). Its tensors keep LFM2's own
names (`CHECKPOINT_NAMES`); the embeddings are tied. The convolutions carry a state per request
(`recurrent`: state slots, snapshots of them in the radix tree); the model is served on one
rank and without adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family
from radixrt.models.interface import Projection, WeightSource
from radixrt.models.layers import MAX_TAPS, ShortConv


class Lfm2ForCausalLM(Decoder):
    CHECKPOINT_NAMES = {
        "self_attn.o_proj.weight": "self_attn.out_proj.weight",
        "self_attn.q_norm.weight": "self_attn.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attn.k_layernorm.weight",
        "input_layernorm.weight": "operator_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "feed_forward.w1.weight",
        "mlp.up_proj.weight": "feed_forward.w3.weight",
        "mlp.down_proj.weight": "feed_forward.w2.weight",
        "model.norm.weight": "model.embedding_norm.weight",
    }

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, qk_norm=True, norm_eps=config.norm_eps)

    @classmethod
    def layer_kinds_of(cls, config: PretrainedConfig) -> tuple[str, ...]:
        return tuple("conv" if t == "conv" else "attention" for t in config.layer_types)

    @classmethod
    def intermediate_size_of(cls, config: PretrainedConfig) -> int:
        """transformers' `Lfm2MLP` width: 2/3 of the config's, times the multiplier, rounded up
        to `block_multiple_of`, where `block_auto_adjust_ff_dim` asks."""
        width: int = config.intermediate_size
        if config.block_auto_adjust_ff_dim:
            width = int(2 * width / 3)
            if config.block_ffn_dim_multiplier is not None:
                width = int(config.block_ffn_dim_multiplier * width)
                step: int = config.block_multiple_of
                width = step * ((width + step - 1) // step)
        return width

    def make_mixer(self, kind: str, config: PretrainedConfig) -> tuple[str, nn.Module]:
        assert kind == "conv"
        taps = config.conv_L_cache
        if not 2 <= taps <= MAX_TAPS:
            raise ValueError(f"config.json: conv_L_cache is {taps}; radixrt takes 2 to {MAX_TAPS}")
        return "conv", ShortConv(config.hidden_size, taps, config.conv_bias)

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        """The convolution's projections, and its taps (`conv.conv` in the checkpoint)."""
        kinds = ("weight", "bias") if self.config.conv_bias else ("weight",)
        for kind in kinds:
            for ours, theirs in (("in_proj", "in_proj"), ("out_proj", "out_proj"), ("", "conv")):
                name = f"{ours}.{kind}" if ours else kind
                reader.copy_rows(param(f"{me}conv.{name}"), f"{hf}conv.{theirs}.{kind}")

    def projections(self) -> dict[tuple[int, str], Projection]:
        """None: adapters over LFM2 are not served (refused at start by name)."""
        return {}
