"""Bamba (IBM): a decoder whose layers mix either by Mamba-2's selective state space
(`layers.Mamba2Mixer`, "linear_attention" in `layer_types`: every layer but those in
`attn_layer_indices`) or by attention rotating the first half of each head
(`partial_rotary_factor` 0.5, which the config puts in its rope parameters), each followed by a
SwiGLU MLP. Its tensors keep Bamba's own names (`CHECKPOINT_NAMES`). The Mamba layers carry a
state per request (`recurrent`: state slots, snapshots of them in the radix tree); the model is
served on one rank and without adapters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family
from radixrt.models.interface import Projection, WeightSource
from radixrt.models.layers import MAX_TAPS, Mamba2Mixer

# the Mamba-2 mixer's tensors: ours -> the checkpoint's (under `mamba.` in both); the biases
# are read where the mixer has them
MAMBA = {
    "in_proj.weight": "in_proj.weight",
    "in_proj.bias": "in_proj.bias",
    "conv_weight": "conv1d.weight",
    "conv_bias": "conv1d.bias",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "D": "D",
    "norm_weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
    "out_proj.bias": "out_proj.bias",
}


def mamba2_of(config: PretrainedConfig, **options: Any) -> Mamba2Mixer:
    """The Mamba-2 mixer the config's `mamba_*` fields describe (Bamba's, Granite 4's,
    Falcon-H1's, whose heads fill `mamba_d_ssm` where it sets one, else `mamba_expand` times the
    hidden size), with the family's `options` (`Mamba2Mixer`'s keyword arguments), after a
    ValueError naming the field for a shape the mixer cannot take: its convolution's state and
    its heads' split into groups are sized from them."""
    heads, groups, head_dim = config.mamba_n_heads, config.mamba_n_groups, config.mamba_d_head
    inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
    if not 2 <= config.mamba_d_conv <= MAX_TAPS:
        raise ValueError(
            f"config.json: mamba_d_conv is {config.mamba_d_conv}; radixrt takes 2 to {MAX_TAPS}"
        )
    if groups < 1 or heads % groups:
        raise ValueError(
            f"config.json: mamba_n_heads ({heads}) is not a multiple of mamba_n_groups ({groups})"
        )
    if heads * head_dim != inner:
        raise ValueError(
            f"config.json: mamba_n_heads ({heads}) times mamba_d_head ({head_dim}) is not "
            f"the Mamba layers' width ({inner})"
        )
    for field in ("mamba_chunk_size", "mamba_d_state"):
        if getattr(config, field) < 1:
            raise ValueError(f"config.json: {field} is {getattr(config, field)}; it must be >= 1")
    if config.hidden_act != "silu":  # the convolution's activation
        raise ValueError(f"config.json: hidden_act {config.hidden_act!r}; Mamba-2 takes 'silu'")
    low, high = config.time_step_limit or (0.0, float("inf"))
    return Mamba2Mixer(
        config.hidden_size,
        (heads, head_dim, groups),
        config.mamba_d_state,
        config.mamba_d_conv,
        config.mamba_chunk_size,
        (bool(config.mamba_proj_bias), bool(config.mamba_conv_bias)),
        config.rms_norm_eps,
        (float(low), float(high)),
        **options,
    )


class BambaForCausalLM(Decoder):
    CHECKPOINT_NAMES = {
        "post_attention_layernorm.weight": "pre_ff_layernorm.weight",
        "mlp.gate_proj.weight": "feed_forward.gate_proj.weight",
        "mlp.up_proj.weight": "feed_forward.up_proj.weight",
        "mlp.down_proj.weight": "feed_forward.down_proj.weight",
        "model.norm.weight": "model.final_layernorm.weight",
    }

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config)

    @classmethod
    def layer_kinds_of(cls, config: PretrainedConfig) -> tuple[str, ...]:
        return tuple(
            "mamba" if t == "linear_attention" else "attention" for t in config.layer_types
        )

    def make_mixer(self, kind: str, config: PretrainedConfig) -> tuple[str, nn.Module]:
        assert kind == "mamba"
        return "mamba", mamba2_of(config)

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        """The mixer's tensors (under `mamba.` in both), its biases where it has them."""
        own = dict(self.get_submodule(me + "mamba").named_parameters())
        for ours, theirs in MAMBA.items():
            if ours in own:
                reader.copy_rows(param(f"{me}mamba.{ours}"), f"{hf}mamba.{theirs}")

    def projections(self) -> dict[tuple[int, str], Projection]:
        """None: adapters over Bamba are not served (refused at start by name)."""
        return {}
