"""What a checkpoint asks for that cannot be honoured is refused at load with one line naming
the field; a sliding window is attended as such, so it no longer caps the context: greedy tokens
equal transformers' past it (tiny random checkpoints made with transformers' configs)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.executor.model_runner import ModelRunner
from radixrt.models.support import check_supported

from helpers import TINY, hf_greedy, run_in_process

SMALL = dict(TINY, max_position_embeddings=256, tie_word_embeddings=False)


def _checkpoint(folder, tiny_model_dir, model_type: str = "llama", **extra):
    config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    return folder


def _runner(folder, **overrides) -> ModelRunner:
    args = {"model": str(folder), "attention_backend": "torch", "max_total_tokens": 512}
    return ModelRunner(ServerArgs(**{**args, **overrides}).executor)


def _edit_config(folder, **fields) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "fields, words",
    [
        (
            {"quantization_config": {"quant_method": "awq", "bits": 3}},
            "quantization_config (awq) bits 3",
        ),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling type 'dynamic'",
        ),
        # Gemma 3's option for embedding models: attention is causal here
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        # a context no rotary table should be sized by (the 2^32 - 1: 4.3 GB in 24 s)
        ({"max_position_embeddings": 2**32 - 1}, "max_position_embeddings 4294967295"),
    ],
)
def test_config_fields_that_cannot_be_honoured_are_refused(tmp_path, tiny_model_dir, fields, words):
    folder = _checkpoint(tmp_path, tiny_model_dir)
    _edit_config(folder, **fields)
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match="^config.json: ") as refused:
        check_supported(config, None)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_unused_missing_and_misshapen_tensors_are_refused(tmp_path, tiny_model_dir):
    folder = _checkpoint(tmp_path, tiny_model_dir)
    weights = load_file(folder / "model.safetensors")
    save_file(
        {**weights, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)},
        folder / "model.safetensors",
    )
    with pytest.raises(ValueError, match="does not use.*extra_proj"):
        _runner(folder)
    up = weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.*missing"):
        _runner(folder)
    # one row where the model has many: refused, not broadcast over the parameter
    save_file(
        {**weights, "model.layers.1.mlp.up_proj.weight": up[:1]}, folder / "model.safetensors"
    )
    with pytest.raises(ValueError, match="up_proj.*read, the model has"):
        _runner(folder)


def test_a_sliding_window_keeps_the_whole_context_and_stays_exact(tmp_path, tiny_model_dir):
    """Mistral with a 32-token window serves its whole 256-token context (and a 64-token one
    asked for); prompts longer than the window, then the same again from the cache, give
    transformers' greedy tokens."""
    folder = _checkpoint(tmp_path, tiny_model_dir, "mistral", sliding_window=32)
    assert check_supported(AutoConfig.from_pretrained(folder), 64) == 64
    scheduler = Scheduler.from_server_args(
        ServerArgs(model=str(folder), attention_backend="torch", max_total_tokens=512)
    )
    assert scheduler.runner.context_length == 256
    prompts = [list(range(100, 150)), list(range(300, 310)) + list(range(100, 140))]
    outs = run_in_process(
        scheduler, [prompts, prompts], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    assert outs == hf_greedy(folder, prompts, 8) * 2
    assert scheduler.stats()["cached_prompt_tokens_total"] > 0


def test_longrope_caps_the_context_at_its_original_length(tmp_path, tiny_model_dir):
    """Past original_max_position_embeddings transformers switches to the long factors by the
    sequence's length, which one table cannot follow: the context is capped there (where the
    short-factor table is exact) and a longer one asked for is refused in one line."""
    folder = _checkpoint(tmp_path, tiny_model_dir)
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128,
    }
    _edit_config(folder, rope_scaling=rope)
    config = AutoConfig.from_pretrained(folder)
    assert check_supported(config, None) == 128
    assert check_supported(config, 100) == 100
    with pytest.raises(ValueError, match="^config.json: rope_scaling longrope") as refused:
        check_supported(config, 200)
    assert "original_max_position_embeddings 128" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_qwen2_with_its_window_switched_off_keeps_its_context(tmp_path, tiny_model_dir):
    folder = _checkpoint(
        tmp_path, tiny_model_dir, "qwen2", sliding_window=32, use_sliding_window=False
    )
    assert check_supported(AutoConfig.from_pretrained(folder), None) == 256


def _safetensors(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (_safetensors(b"{}", length=2**63), "header of 9223372036854775808 bytes"),
        (_safetensors(b"[" * 100 + b"]" * 100), "not a JSON object"),
        (_safetensors(b"{" * 100_000), "not JSON"),
        (_safetensors(b'{"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}'), "dtype"),
        (
            _safetensors(
                b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551616]}}'
            ),
            "outside the file",
        ),
        (
            _safetensors(
                b'{"w": {"dtype": "F32", "shape": [4096, 4096], "data_offsets": [0, 4]}}', bytes(4)
            ),
            "do not hold shape",
        ),
        (
            _safetensors(
                b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', bytes(4)
            ),
            "not a list of sizes",
        ),
    ],
)
def test_hostile_safetensors_headers_are_refused_by_name(tmp_path, content, words):
    """A safetensors file is input: its header's length, entries and offsets are checked against
    the file before anything is read or allocated by them (one line naming the file)."""
    from radixrt.executor.model_loader import WeightReader

    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors") as refused:
        WeightReader(tmp_path)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000"),
        ({"hidden_size": 10**6}, "vocab_size x hidden_size"),
    ],
)
def test_config_sizes_past_the_weights_are_refused_before_building(
    tmp_path, tiny_model_dir, fields, words
):
    """config.json is input too: a layer count or a width its weights cannot hold is refused
    by name before the model is built or allocated by it (10^9 layers, a 10^6 width)."""
    folder = _checkpoint(tmp_path, tiny_model_dir)
    _edit_config(folder, **fields)
    with pytest.raises(ValueError, match="^config.json: ") as refused:
        _runner(folder)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_a_tokenizer_or_config_file_past_its_bound_is_refused_by_name(
    tmp_path, tiny_model_dir, name
):
    """Files parsed whole are bounded before a parser reads them: a (sparse) 300 MiB
    tokenizer.json or 20 MiB config.json is refused in one line naming it."""
    from radixrt.executor.model_loader import FILE_LIMITS

    folder = _checkpoint(tmp_path, tiny_model_dir)
    os.truncate(folder / name, FILE_LIMITS[name] + 1)
    with pytest.raises(
        ValueError, match=f"^{name}: {FILE_LIMITS[name] + 1} bytes, past"
    ) as refused:
        _runner(folder)
    assert "\n" not in str(refused.value)
