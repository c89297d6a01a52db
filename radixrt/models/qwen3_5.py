"""Qwen3.5 (text, dense): three Gated DeltaNet layers (`layers.GatedDeltaNet`, "linear_attention"
in `layer_types`) to each attention layer; attention with q/k norms per head, partial rotary and
an output gate (q_proj's rows: each head's query, then its gate); zero-centred RMSNorms (scaled by
1 + w) but the Gated DeltaNet's own output norm, which scales by w. The linear-attention layers
carry a state per request (`recurrent`: state slots, snapshots of them in the radix tree); the
model is served on one rank and without adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family
from radixrt.models.interface import Projection, WeightSource
from radixrt.models.layers import MAX_TAPS, GatedDeltaNet

# the Gated DeltaNet's tensors: ours -> the checkpoint's (under `linear_attn.` in both)
LINEAR_ATTENTION = {
    "in_proj_qkv.weight": "in_proj_qkv.weight",
    "in_proj_z.weight": "in_proj_z.weight",
    "in_proj_b.weight": "in_proj_b.weight",
    "in_proj_a.weight": "in_proj_a.weight",
    "conv_weight": "conv1d.weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm_weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}


class Qwen3_5ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, qk_norm=True, norm_offset=1.0, attn_output_gate=True)

    @classmethod
    def layer_kinds_of(cls, config: PretrainedConfig) -> tuple[str, ...]:
        return tuple(
            "linear" if t == "linear_attention" else "attention" for t in config.layer_types
        )

    def make_mixer(self, kind: str, config: PretrainedConfig) -> tuple[str, nn.Module]:
        assert kind == "linear"
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if k_heads < 1 or v_heads % k_heads:
            raise ValueError(
                f"config.json: linear_num_value_heads ({v_heads}) is not a multiple of "
                f"linear_num_key_heads ({k_heads})"
            )
        if not 2 <= config.linear_conv_kernel_dim <= MAX_TAPS:
            raise ValueError(
                f"config.json: linear_conv_kernel_dim is {config.linear_conv_kernel_dim}; "
                f"radixrt takes 2 to {MAX_TAPS}"
            )
        mixer = GatedDeltaNet(
            config.hidden_size,
            (config.linear_num_key_heads, config.linear_num_value_heads),
            (config.linear_key_head_dim, config.linear_value_head_dim),
            config.linear_conv_kernel_dim,
            config.rms_norm_eps,
        )
        return "linear_attn", mixer

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        for ours, theirs in LINEAR_ATTENTION.items():
            reader.copy_rows(param(f"{me}linear_attn.{ours}"), f"{hf}linear_attn.{theirs}")

    def projections(self) -> dict[tuple[int, str], Projection]:
        """None: adapters over Qwen3.5 are not served (refused at start by name)."""
        return {}
