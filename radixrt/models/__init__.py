"""Model architectures by the name in a checkpoint's config.json."""

from radixrt.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES = {"llama", "mistral", "qwen2"}


def model_class(config) -> type:
    for arch in getattr(config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if config.model_type in MODEL_TYPES:
        return LlamaForCausalLM
    raise ValueError(
        f"unsupported architecture {config.architectures}; supported: {sorted(ARCHITECTURES)}"
    )
