"""Phi-3 and Phi-4: Llama's decoder whose checkpoint keeps `qkv_proj` and `gate_up_proj` fused
(split by rows at load, so a tensor-parallel rank still reads only its part), rotary over part
of each head where `partial_rotary_factor` says (Phi-4's 0.75)."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family


class Phi3ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, fused_checkpoint=frozenset({"qkv_proj", "gate_up_proj"}))
