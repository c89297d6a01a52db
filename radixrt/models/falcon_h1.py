"""TII's Falcon-H1 (`FalconH1ForCausalLM`): every layer ("hybrid" in `layer_types`) runs
attention and a Mamba-2 mixer side by side on the same normed input and adds both outputs to
the stream (`ParallelMixer`), then a SwiGLU MLP. Its μP multipliers scale the arithmetic where
transformers applies them: the embeddings (`embedding_multiplier`), each key before rotary
(`key_multiplier`), the MLP's gate and output (`mlp_multipliers`) and the logits
(`lm_head_multiplier`) as `Family` fields; each half's input and output (`attention_in/out_`,
`ssm_in/out_multiplier`) in the parallel mixer; the Mamba projection's z, x, B, C and dt parts
(`ssm_multipliers`) in the mixer itself. Its Mamba-2 is `mamba_d_ssm` wide, its gated norm
optional (`mamba_rms_norm`, and normed before or after the gate: `mamba_norm_before_gate`).
The checkpoint keeps Bamba's names (`self_attn.`, `mamba.`, `feed_forward.`,
`pre_ff_layernorm`, `final_layernorm`). Every layer writes a KV-pool layer of its own and
carries a Mamba state per request: served on one rank, without adapters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.attention import AttentionBackend
from radixrt.forward_batch import ForwardBatch
from radixrt.models.bamba import BambaForCausalLM, mamba2_of
from radixrt.models.family import Family, decoder_family
from radixrt.models.interface import WeightSource
from radixrt.models.layers import Attention, Mamba2Mixer

# the layer's kind, and the name the layer keeps its parallel mixer under (the checkpoint
# keeps the two halves in the layer itself: `self_attn.`, `mamba.`)
HYBRID = "hybrid"


@dataclass(frozen=True)
class Multipliers:
    """The factors of each half's input and output in a `ParallelMixer`."""

    attention_in: float
    attention_out: float
    ssm_in: float
    ssm_out: float

    @classmethod
    def of(cls, config: PretrainedConfig) -> Multipliers:
        return cls(
            float(config.attention_in_multiplier),
            float(config.attention_out_multiplier),
            float(config.ssm_in_multiplier),
            float(config.ssm_out_multiplier),
        )


class ParallelMixer(nn.Module):
    """Attention (`self_attn`, the layer's KV-pool layer) and Mamba-2 (`mamba`) over the same
    normed input, each's input and output scaled by its `Multipliers`: mamba's output plus
    attention's, summed in transformers' order. Called as a layer's mixer is."""

    def __init__(self, attention: Attention, mamba: Mamba2Mixer, scales: Multipliers):
        super().__init__()
        self.self_attn, self.mamba, self.scales = attention, mamba, scales

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        s = self.scales
        ssm = self.mamba(x * s.ssm_in, batch, cos_sin, attn) * s.ssm_out
        attention = self.self_attn(x * s.attention_in, batch, cos_sin, attn) * s.attention_out
        out: torch.Tensor = ssm + attention
        return out


def mamba_of(config: PretrainedConfig) -> Mamba2Mixer:
    """Falcon-H1's Mamba-2 mixer (`bamba.mamba2_of`): its out projection's bias, its gated
    norm (none, or before or after the gate) and its in-projection's parts' multipliers."""
    gate_norm = None
    if config.mamba_rms_norm:
        gate_norm = "before_gate" if config.mamba_norm_before_gate else "after_gate"
    z, x, b, c, dt = (float(f) for f in config.ssm_multipliers)
    return mamba2_of(
        config,
        out_bias=bool(config.projectors_bias),
        gate_norm=gate_norm,
        proj_scales=(z, x, b, c, dt),
    )


class FalconH1ForCausalLM(BambaForCausalLM):
    """Bamba's tensor names and Mamba-2 tensors (`load_mixer`), every layer a `ParallelMixer`
    (`mixer_of`: its attention is the layer's own, so every layer attends: `ATTENDING`)."""

    ATTENDING = frozenset({HYBRID})

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        """After a ValueError for biases the shared layers do not hold (attention's output
        projection's, the MLP's)."""
        for field in ("attention_bias", "mlp_bias"):
            if getattr(config, field, False):
                raise ValueError(f"config.json: {field} is set; radixrt serves Falcon-H1 without")
        gate, down = config.mlp_multipliers
        return decoder_family(
            config,
            embed_scale=float(config.embedding_multiplier),
            logits_scale=float(config.lm_head_multiplier),
            key_scale=float(config.key_multiplier),
            mlp_scales=(float(gate), float(down)),
        )

    @classmethod
    def layer_kinds_of(cls, config: PretrainedConfig) -> tuple[str, ...]:
        layers: int = config.num_hidden_layers
        return (HYBRID,) * layers

    def mixer_of(self, config: PretrainedConfig, i: int) -> tuple[str, nn.Module]:
        mixer = ParallelMixer(
            self.attention_of(config, i), mamba_of(config), Multipliers.of(config)
        )
        return HYBRID, mixer

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        """The attention's tensors (`self_attn.` in the checkpoint) and the Mamba mixer's
        (`mamba.`), each under the parallel mixer in the model."""
        self.load_attention(reader, hf + "self_attn.", f"{me}{HYBRID}.self_attn.", param)
        super().load_mixer(reader, kind, hf, f"{me}{HYBRID}.", param)
