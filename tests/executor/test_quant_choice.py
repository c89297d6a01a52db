"""`--quantization auto`, the default: a model given as a GGUF file is served as stored (its
quantized linears packed), a float checkpoint stays float, and packing is not taken where it
cannot run; `none` dequantizes. Against the default model's real GGUF (SmolLM2-135M, Q4_1)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from radixrt.config import ServerArgs
from radixrt.executor import gguf_weights
from radixrt.executor.model_loader import converted_from, default_gguf_path
from radixrt.executor.model_runner import ModelRunner
from radixrt.executor.quant_choice import Ground, choose
from radixrt.kernels import cpu_isa, int4_gemm
from radixrt.models.linear import GroupedLinear

pytestmark = [
    pytest.mark.skipif(not int4_gemm.available(), reason="packed GGUF needs AVX2 and a compiler"),
    pytest.mark.model,  # the default model
]


def _ground(default_model_dir, model: str = "default", **change) -> Ground:
    fields = dict(
        model_arg=model,
        source=converted_from(default_model_dir),
        compute_device=torch.device("cpu"),
        isa=cpu_isa.resolve("auto", cpu_isa.host_paths()),
        tp_size=1,
        deterministic=False,
        prequantized=False,
    )
    return Ground(**{**fields, **change})


def test_auto_serves_a_gguf_as_stored_and_a_folder_as_float(default_model_dir):
    config = AutoConfig.from_pretrained(default_model_dir)
    packed = choose("auto", _ground(default_model_dir), config)
    assert packed.name == "gguf" and packed.plan is not None and packed.plan.linears
    assert "as stored" in packed.reason
    for model in (str(default_gguf_path()), "default"):
        assert choose("auto", _ground(default_model_dir, model), config).name == "gguf"
    folder = choose("auto", _ground(default_model_dir, str(default_model_dir)), config)
    assert folder.name is None and "float checkpoint" in folder.reason
    for requested in ("none", None):
        assert choose(requested, _ground(default_model_dir), config).name is None


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(tp_size=2), "tensor-parallel"),
        (dict(deterministic=True), "deterministic"),
        (dict(isa=None, compute_device=torch.device("meta")), "CPUs and CUDA GPUs only"),
    ],
)
def test_auto_falls_back_to_float_where_packing_cannot_run(default_model_dir, change, why):
    config = AutoConfig.from_pretrained(default_model_dir)
    chosen = choose("auto", _ground(default_model_dir, **change), config)
    assert chosen.name is None and chosen.plan is None
    assert why in chosen.reason


def test_auto_serves_a_gguf_without_packed_linears_as_float(default_model_dir, tmp_path):
    """A GGUF whose linears are all float32 is served float under auto, the reason named; an
    explicit gguf is refused for it, and for a model that never was GGUF."""
    path = tmp_path / "float.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        writer.add_tensor(name, np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = AutoConfig.from_pretrained(default_model_dir)
    ground = _ground(default_model_dir, str(path), source=path)
    chosen = choose("auto", ground, config)
    assert chosen.name is None and "has no" in chosen.reason
    with pytest.raises(ValueError, match="has no"):
        choose("gguf", ground, config)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        choose("gguf", _ground(default_model_dir, str(default_model_dir), source=None), config)


def test_the_default_model_is_served_packed_unless_none_is_asked():
    """The runner takes the choice: packed 4-bit groups under the default, float under none;
    model_info's quantization and its reason say which."""
    packed = ModelRunner(ServerArgs(max_total_tokens=256).executor)
    assert packed.quantization_path == "gguf" and "as stored" in packed.quant.reason
    assert any(isinstance(m, GroupedLinear) for m in packed.model.modules())
    floats = ModelRunner(ServerArgs(max_total_tokens=256, quantization="none").executor)
    assert floats.quantization_path == "float"
    assert not any(isinstance(m, GroupedLinear) for m in floats.model.modules())


def test_the_packed_copy_reads_back_the_same_groups(default_model_dir, tmp_path):
    """`read_linears` with a cache file: the first read packs and writes it (removing an older
    layout's copy), the second reads it back; both give the groups packed from the file's
    blocks, bit for bit."""
    config = AutoConfig.from_pretrained(default_model_dir)
    plan = gguf_weights.plan(default_gguf_path(), config)
    cache = gguf_weights.packed_cache(tmp_path)
    older = tmp_path / f"{gguf_weights.PACKED_CACHE}-v1"  # an older layout's copy
    older.write_bytes(b"stale")
    fresh = gguf_weights.read_linears(plan)
    written = gguf_weights.read_linears(plan, cache)
    assert cache.is_file() and not older.exists()
    read_back = gguf_weights.read_linears(plan, cache)
    for name, weight in fresh.items():
        for other in (written[name], read_back[name]):
            assert torch.equal(other.tiles, weight.tiles)
            assert torch.equal(other.scales, weight.scales)
            assert (other.out_features, other.in_features, other.bits) == (
                weight.out_features,
                weight.in_features,
                weight.bits,
            )
