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
        return decoder_family(config, qk_norm=True, moe=sparse_layers_of(config))


def sparse_layers_of(config: PretrainedConfig, shared: int = 0) -> MoeSpec:
    """The experts of Qwen's MoE families (Qwen3-MoE; with a `shared` expert that wide,
    Qwen3-Next) on the layers transformers makes sparse: every `decoder_sparse_step`-th layer
    not listed in `mlp_only_layers`."""
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
    return MoeSpec(
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
        shared_intermediate_size=shared,
    )
