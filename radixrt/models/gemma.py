"""Gemma 2 and Gemma 3 (text): norms that scale by (1 + w), embeddings scaled by
sqrt(hidden_size), sandwich norms around attention and the MLP, GELU (tanh), queries scaled by
1/sqrt(query_pre_attn_scalar), local layers windowed by `layer_types`; Gemma 2 soft-caps its
attention scores and logits, Gemma 3 norms each head's q and k and gives local and global layers
rotary tables of their own."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family


def gemma_parts(config: PretrainedConfig) -> dict[str, Any]:
    """The `Family` fields both Gemmas set away from their defaults."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return dict(
        norm_offset=1.0,
        embed_scale=config.hidden_size**0.5,
        sandwich_norms=True,
        query_scale=(head_dim / config.query_pre_attn_scalar) ** 0.5,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
        windows_by_layer_type=True,
    )


class Gemma2ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, **gemma_parts(config))


class Gemma3ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, qk_norm=True, **gemma_parts(config))
