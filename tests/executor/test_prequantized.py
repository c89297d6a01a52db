"""Pre-quantized checkpoints served packed (`models/quantized.py`): GPTQ and AWQ ones in their
published layouts (`quant_packers.py`) of a small trained model (the default model's first
layers), held against transformers' loading of their dequantized weights (transformers reads
neither format on a CPU without GPTQModel or AutoAWQ): with the weights dequantized at each
call (`--cpu-isa torch`) the logits are transformers' within float16's rounding of the
offsets; through the C kernels (8-bit activations) within int4's quality gates. What cannot be
honoured is refused in one line. llm-compressor's checkpoints: test_prequantized_llmcompressor.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from radixrt.kernels import int4_gemm
from radixrt.models import quantized
from radixrt.models.linear import GroupedLinear
from radixrt.models.support import check_supported

from quant_packers import (
    EXACT,
    LAYERS,
    ct_int_group,
    held_to_transformers,
    quality_ids,
    runner,
    transformers_logits,
    write_dequantized,
    write_quantized,
)

pytestmark = [
    pytest.mark.skipif(not int4_gemm.available(), reason="packed weights need AVX2 and a compiler"),
    pytest.mark.model,  # the default model's first layers
]


@pytest.fixture(scope="module")
def ids(small_model_dir) -> list[int]:
    return quality_ids(small_model_dir)


@pytest.mark.parametrize(
    "method, group, symmetric, desc_act",
    [
        ("gptq", 128, True, False),
        ("gptq", 128, False, True),
        ("gptq", 64, True, True),
        ("awq", 64, False, False),
    ],
)
def test_gptq_and_awq_layouts_load_packed_within_the_gates(
    tmp_path, small_model_dir, ids, method, group, symmetric, desc_act
):
    """GPTQ at group 128 on inputs of 576: the last group is 64 wide (AutoGPTQ's ceil)."""
    folder, float_folder = tmp_path / method, tmp_path / "dequantized"
    dequantized = write_quantized(small_model_dir, folder, method, group, symmetric, desc_act)
    write_dequantized(small_model_dir, float_folder, dequantized)
    reference = transformers_logits(float_folder, ids)
    name = f"{method} g{group} {'sym' if symmetric else 'asym'}{' act-order' if desc_act else ''}"
    packed = held_to_transformers(folder, ids, reference, name, EXACT)
    linears = [m for m in packed.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * LAYERS
    assert all((m.perm is not None) == desc_act for m in linears)
    float_bytes = 4 * sum(w.numel() for w in dequantized.values())
    assert sum(m.weight.nbytes for m in linears) < float_bytes / 5  # 0.625 bytes a weight
    path = packed.quantization_path
    assert path.startswith(method) and ("act-order" in path) == desc_act


def _with_quant(tmp_path, small_model_dir, quant: dict):
    folder = tmp_path / "refused"
    folder.mkdir(exist_ok=True)
    config = json.loads((small_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return AutoConfig.from_pretrained(folder)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_W4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": ct_int_group(4, 128, True),
}


@pytest.mark.parametrize(
    "quant, words",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({**GPTQ, "bits": 3}, "bits 3"),
        ({**GPTQ, "bits": 2}, "bits 2"),
        ({**GPTQ, "group_size": 48}, "group_size 48"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({**GPTQ, "dynamic": {"-:.*down": {}}}, "dynamic"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({**CT_W4, "format": "marlin-24"}, "format 'marlin-24'"),
        ({**CT_W4, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({**CT_W4, "config_groups": ct_int_group(4, 128, False, "tensor")}, "int tensor"),
        (
            {
                **CT_W4,
                "format": "int-quantized",
                "config_groups": ct_int_group(8, 0, False, "channel"),
            },
            "asymmetric",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(tmp_path, small_model_dir, quant, words):
    config = _with_quant(tmp_path, small_model_dir, quant)
    with pytest.raises(ValueError, match="^config.json: quantization_config") as refused:
        check_supported(config, None)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_act_orders_that_cannot_be_fused_and_requantizing_are_refused(tmp_path, small_model_dir):
    """q, k and v run as one linear: their inputs must fall in the same groups. A
    pre-quantized checkpoint is not quantized again by --quantization, and its float rest
    runs in float32 (prepacked)."""
    folder = tmp_path / "gptq"
    write_quantized(small_model_dir, folder, "gptq", 64, True, desc_act=True)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    weights[name] = weights[name].flip(0).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="act-order: .*k_proj groups its inputs unlike"):
        runner(folder)
    with pytest.raises(ValueError, match="already quantized"):
        runner(folder, quantization="int4")
    with pytest.raises(
        ValueError, match="served packed on one rank: on the CPU in float32, or on a CUDA GPU"
    ):
        runner(folder, dtype="bfloat16")


@pytest.mark.parametrize("bits", [4, 8])
def test_integers_unpack_and_map_onto_the_kernels_groups(bits):
    """Words of 32/bits values unpack in the published order (value j in bits bits*j), and
    grouped integers, act-order included, dequantize from the kernel's groups to s (q - z)
    within float16's rounding of s and s z (8-bit groups: q - 128 and m = s (128 - z))."""
    g = torch.Generator().manual_seed(bits)
    words = torch.randint(-(2**31), 2**31 - 1, (24, 9), dtype=torch.int32, generator=g)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    expected = (words[..., None] >> shifts) & ((1 << bits) - 1)
    assert torch.equal(quantized._unpack(words, bits), expected.reshape(24, -1).to(torch.uint8))
    n, k, group = 24, 320, 64
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // group, generator=g) / 8
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    groups = torch.empty(k, dtype=torch.long)
    groups[torch.randperm(k, generator=g)] = torch.arange(k) // group  # act-order
    packed = quantized._to_groups(quantized.GroupInts(q, scale, zero, groups), bits)
    assert isinstance(packed, quantized.PermutedGroups)
    ours = torch.empty(n, k)
    ours[:, packed.perm] = packed.weight.dequantize()
    theirs = scale[:, groups] * (q.float() - zero[:, groups])
    assert torch.allclose(ours, theirs, atol=(scale.max() * (1 << bits) * 2**-10).item())
