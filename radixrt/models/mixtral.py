"""Mixtral: Mistral's attention over experts on every layer (`block_sparse_moe`, w1/w3/w2), the
chosen experts' softmax weights renormalised to sum to 1."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, MoeSpec, decoder_family


class MixtralForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        moe = MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            prefix="block_sparse_moe",
            names=("w1", "w3", "w2"),
            sparse_layers=frozenset(range(config.num_hidden_layers)),
        )
        return decoder_family(config, moe=moe)
