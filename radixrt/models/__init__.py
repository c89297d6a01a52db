"""Model architectures by the name in a checkpoint's config.json, declared once each: the class
that serves it (imported only when a checkpoint asks for it) and its `model_type`, by which a
config without `architectures` is matched. Today every family is the one decoder skeleton
(llama.py) with the parts its `Family` names (family.py); a family not shaped like Llama adds its
own module and class here, deriving `interface.CausalLM`."""

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


LLAMA = ("llama", "LlamaForCausalLM")
ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", *LLAMA),
    Architecture("MistralForCausalLM", "mistral", *LLAMA),
    Architecture("Qwen2ForCausalLM", "qwen2", *LLAMA),
    Architecture("Qwen3ForCausalLM", "qwen3", *LLAMA),
    Architecture("Phi3ForCausalLM", "phi3", *LLAMA),
    Architecture("MixtralForCausalLM", "mixtral", *LLAMA),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", *LLAMA),
    Architecture("Gemma2ForCausalLM", "gemma2", *LLAMA),
    Architecture("Gemma3ForCausalLM", "gemma3_text", *LLAMA),
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
