"""The architecture registry, without a model: matched by `architectures`, then `model_type`,
refused by name otherwise; each entry's class keeps the `CausalLM` contract the executor reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixrt.models import ARCHITECTURES, architecture_of, model_class


def test_a_config_is_matched_by_architecture_then_by_model_type():
    qwen = SimpleNamespace(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    assert architecture_of(qwen).model_type == "qwen3"
    renamed = SimpleNamespace(architectures=["MyLlamaForCausalLM"], model_type="llama")
    assert architecture_of(renamed).name == "LlamaForCausalLM"
    bare = SimpleNamespace(model_type="gemma3_text")
    assert architecture_of(bare).name == "Gemma3ForCausalLM"


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        architecture_of(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


def test_each_entry_is_declared_once_and_names_a_class_with_the_contracts_methods():
    """Its data members (family, shard, ...) are set in __init__: `load_model` checks the built
    model against `CausalLM`, and the family tests build every one."""
    assert len({a.name for a in ARCHITECTURES}) == len(ARCHITECTURES)
    assert len({a.model_type for a in ARCHITECTURES}) == len(ARCHITECTURES)
    for arch in ARCHITECTURES:
        cls = model_class(SimpleNamespace(architectures=[arch.name]))
        assert all(
            callable(getattr(cls, m)) for m in ("__call__", "compute_logits", "load_weights")
        )
