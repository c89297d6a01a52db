"""Qwen3.5 (text, dense and MoE) and its predecessor Qwen3-Next: three Gated DeltaNet layers
(`layers.GatedDeltaNet`, "linear_attention" in `layer_types`) to each attention layer; attention
with q/k norms per head, partial rotary and an output gate (q_proj's rows: each head's query,
then its gate); zero-centred RMSNorms (scaled by 1 + w) but the Gated DeltaNet's own output norm,
which scales by w. The MoE models' experts come with a shared expert, gated by a sigmoid
(`MoeSpec.shared_intermediate_size`). Qwen3-Next's checkpoints keep the Gated DeltaNet's input
projections fused and interleaved by key head (`in_proj_qkvz`, `in_proj_ba`), read here as
Qwen3.5's four (a GGUF file's `in_proj_qkvz` holds its rows by projection: `QKVZ_BY_PROJECTION`). The linear-attention layers carry a state per request (`recurrent`: state slots,
snapshots of them in the radix tree); the models are served on one rank and without adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, MoeSpec, decoder_family
from radixrt.models.interface import Projection, WeightSource
from radixrt.models.layers import MAX_TAPS, GatedDeltaNet
from radixrt.models.qwen import sparse_layers_of

# a config field set on a model read from llama.cpp's GGUF, whose value heads are in its tiled
# order (`GatedDeltaNet`'s `tiled`)
TILED_VALUE_HEADS = "linear_value_heads_tiled"
# a config field set on Qwen3-Next read from llama.cpp's GGUF, whose `in_proj_qkvz` holds every
# key head's q rows, then k, v and z (the converter's split, stacked back: `gguf_families`)
QKVZ_BY_PROJECTION = "linear_qkvz_by_projection"
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
            bool(getattr(config, TILED_VALUE_HEADS, False)),
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


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's layers over experts on every layer (their top k always renormalised) and a
    shared expert; no dense MLP."""

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        moe = MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
            prefix="mlp",
            names=("gate_proj", "up_proj", "down_proj"),
            sparse_layers=frozenset(range(config.num_hidden_layers)),
            shared_intermediate_size=config.shared_expert_intermediate_size,
        )
        return decoder_family(config, qk_norm=True, norm_offset=1.0, attn_output_gate=True, moe=moe)

    @classmethod
    def intermediate_size_of(cls, config: PretrainedConfig) -> int:
        return 0  # every layer is sparse


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's layers (its norms, gated attention and Gated DeltaNet) over Qwen3-MoE's sparse
    layers with a shared expert; the Gated DeltaNet's projections fused in the checkpoint."""

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        moe = sparse_layers_of(config, shared=config.shared_expert_intermediate_size)
        return decoder_family(config, qk_norm=True, norm_offset=1.0, attn_output_gate=True, moe=moe)

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        """`in_proj_qkvz` holds, per key head, its query and key rows, then the value and z rows
        of the value heads it serves (or, `QKVZ_BY_PROJECTION`, every key head's q rows, then
        their k, v and z rows); `in_proj_ba` per key head those value heads' b then a rows.
        Each of our four projections stacks its rows from every key head in turn (the
        convolution's channels are q, k, v each over all heads, as the checkpoint's)."""
        c = self.config
        k_heads, kd = c.linear_num_key_heads, c.linear_key_head_dim
        per = c.linear_num_value_heads // k_heads  # value heads per key head
        vd = per * c.linear_value_head_dim
        qkvz, ba = f"{hf}linear_attn.in_proj_qkvz.weight", f"{hf}linear_attn.in_proj_ba.weight"

        def rows(name: str, width: int, span: tuple[int, int]) -> list[tuple[str, int, int]]:
            return [(name, h * width + span[0], h * width + span[1]) for h in range(k_heads)]

        widths = {"q": kd, "k": kd, "v": vd, "z": vd}  # a key head's rows of each
        by_projection = getattr(c, QKVZ_BY_PROJECTION, False)
        parts, at = {}, 0  # at: where head 0's rows of the projection start
        for p, width in widths.items():
            if by_projection:  # head h's after h heads' of the same projection
                parts[p], at = rows(qkvz, width, (at, at + width)), at + k_heads * width
            else:  # head h's in the h-th group of all four's
                parts[p], at = rows(qkvz, sum(widths.values()), (at, at + width)), at + width
        ours = f"{me}linear_attn."
        reader.stack_rows(param(ours + "in_proj_qkv.weight"), parts["q"] + parts["k"] + parts["v"])
        reader.stack_rows(param(ours + "in_proj_z.weight"), parts["z"])
        reader.stack_rows(param(ours + "in_proj_b.weight"), rows(ba, 2 * per, (0, per)))
        reader.stack_rows(param(ours + "in_proj_a.weight"), rows(ba, 2 * per, (per, 2 * per)))
        for name in LINEAR_ATTENTION:
            if not name.startswith("in_proj"):
                theirs = f"{hf}linear_attn.{LINEAR_ATTENTION[name]}"
                reader.copy_rows(param(ours + name), theirs)
