"""Model architectures by the name in a checkpoint's config.json, declared once each: the class
that serves it (imported only when a checkpoint asks for it) and its `model_type`, by which a
config without `architectures` is matched. One module per family, each composing the shared
layers (layers.py): the attention-only families derive the attention decoder (decoder.py) and
name the parts they swap in (their `Family`, family.py); a family shaped otherwise derives
`interface.CausalLM` itself."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Architecture:
    name: str  # as config.json's `architectures` lists it
    model_type: str  # config.json's `model_type`
    module: str  # under radixrt.models
    cls: str


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", "llama", "LlamaForCausalLM"),
    Architecture("MistralForCausalLM", "mistral", "llama", "LlamaForCausalLM"),
    Architecture("Qwen2ForCausalLM", "qwen2", "qwen", "Qwen2ForCausalLM"),
    Architecture("Qwen3ForCausalLM", "qwen3", "qwen", "Qwen3ForCausalLM"),
    Architecture("Phi3ForCausalLM", "phi3", "phi3", "Phi3ForCausalLM"),
    Architecture("MixtralForCausalLM", "mixtral", "mixtral", "MixtralForCausalLM"),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen", "Qwen3MoeForCausalLM"),
    Architecture("Gemma2ForCausalLM", "gemma2", "gemma", "Gemma2ForCausalLM"),
    Architecture("Gemma3ForCausalLM", "gemma3_text", "gemma", "Gemma3ForCausalLM"),
    Architecture("Lfm2ForCausalLM", "lfm2", "lfm2", "Lfm2ForCausalLM"),
    Architecture("Qwen3_5ForCausalLM", "qwen3_5_text", "qwen3_5", "Qwen3_5ForCausalLM"),
    Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qwen3_5", "Qwen3_5MoeForCausalLM"),
    Architecture("Qwen3NextForCausalLM", "qwen3_next", "qwen3_5", "Qwen3NextForCausalLM"),
    Architecture("BambaForCausalLM", "bamba", "bamba", "BambaForCausalLM"),
    Architecture(
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid",
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
    ),
    Architecture("FalconH1ForCausalLM", "falcon_h1", "falcon_h1", "FalconH1ForCausalLM"),
    Architecture(
        "LlavaForConditionalGeneration", "llava", "llava", "LlavaForConditionalGeneration"
    ),
)


def architecture_of(config: PretrainedConfig) -> Architecture:
    """The entry a config names: by `architectures` first, else by `model_type`; a ValueError
    naming the supported ones."""
    names = getattr(config, "architectures", None) or []
    for arch in ARCHITECTURES:
        if arch.name in names:
            return arch
    for arch in ARCHITECTURES:
        if arch.model_type == getattr(config, "model_type", None):
            return arch
    supported = sorted(a.name for a in ARCHITECTURES)
    raise ValueError(f"unsupported architecture {names}; supported: {supported}")


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class that serves `config`'s architecture (a subclass of `interface.CausalLM`, which
    the loader checks: its constructor's arguments are the architecture's own)."""
    arch = architecture_of(config)
    cls: type[nn.Module] = getattr(
        importlib.import_module(f"radixrt.models.{arch.module}"), arch.cls
    )
    return cls
