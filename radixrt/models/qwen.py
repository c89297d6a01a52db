"""Qwen2 (q/k/v biases always), Qwen3 (an RMSNorm over each head's q and k) and Qwen3-MoE
(Qwen3's attention over sparse layers of experts). Qwen2 and Qwen3 window only the layers
`layer_types` marks sliding; Qwen3-MoE windows every layer when `sliding_window` is set."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixrt.models.decoder import Decoder
from radixrt.models.family import Family, MoeSpec, decoder_family


class Qwen2ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, qkv_bias=True, windows_by_layer_type=True)


class Qwen3ForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        return decoder_family(config, qk_norm=True, windows_by_layer_type=True)


class Qwen3MoeForCausalLM(Decoder):
    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        # transformers' Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, and then
        # only every decoder_sparse_step-th layer
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        moe = MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            prefix="mlp",
            names=("gate_proj", "up_proj", "down_proj"),
            sparse_layers=frozenset(
                i
                for i in range(config.num_hidden_layers)
                if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
            ),
        )
        return decoder_family(config, qk_norm=True, moe=moe)
