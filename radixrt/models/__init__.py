"""Model architectures by the name in a checkpoint's config.json: every family is the one
decoder skeleton (llama.py) with the parts its `Family` names (family.py)."""

from radixrt.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
}


def model_class(config) -> type:
    for arch in getattr(config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if config.model_type in MODEL_TYPES:
        return LlamaForCausalLM
    raise ValueError(
        f"unsupported architecture {config.architectures}; supported: {sorted(ARCHITECTURES)}"
    )
