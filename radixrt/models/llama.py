"""Llama (and the checkpoints shaped like it: Mistral, SmolLM): the attention decoder as it is,
q/k/v biases only where the config sets `attention_bias`, sliding windows (Mistral's) on every
layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, decoder_family


class LlamaForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config)
