"""Pre-quantized checkpoints served packed (`models/quantized.py`): compressed-tensors ones
written by llm-compressor's one-shot (W4A16 by round-to-nearest and by GPTQ, W8A8, FP8), GPTQ
and AWQ ones by the published layouts' packers (`quant_packers.py`), of a small trained model
(the default model's first layers). Each is held against transformers' own loading of the same
checkpoint (compressed-tensors' decompression; for GPTQ and AWQ, which transformers reads on a
CPU only through GPTQModel or AutoAWQ, the dequantized weights in float): with the weights
dequantized (`--cpu-isa torch`) the logits are transformers' within float16's rounding of the
scales; through the C kernels (8-bit activations) within int4's quality gates. What cannot be
honoured is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from radixrt.config import ServerArgs
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import int4_gemm
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.linear import GroupedLinear, Int8Linear
from radixrt.models.support import check_supported

from helpers import QUALITY_POSITIONS, QUALITY_TEXT, QualityReference, quality_gates
from quant_packers import copy_tokenizer, write_dequantized, write_quantized

pytestmark = [
    pytest.mark.skipif(not int4_gemm.available(), reason="packed weights need AVX2 and a compiler"),
    pytest.mark.model,  # the default model's first layers
]
LAYERS = 2  # of the default model's 30: a trained model small enough to quantize in seconds
POSITIONS = QUALITY_POSITIONS  # of the quality text, teacher-forced (the gates' own)
# float16 scales and offsets, float32 sums in another order: logits of about 20 differ by
EXACT = 0.05
CALIBRATION = 8  # sequences of 64 tokens GPTQ sees


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, default_model_dir):
    """The default model's first `LAYERS` layers, as a float checkpoint."""
    folder = tmp_path_factory.mktemp("small")
    model = AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, num_hidden_layers=LAYERS
    )
    model.save_pretrained(folder)
    copy_tokenizer(default_model_dir, folder)
    return folder


@pytest.fixture(scope="module")
def ids(small_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(small_dir)
    return tokenizer.encode(QUALITY_TEXT.read_text())[: POSITIONS + 1]


def transformers_logits(folder, ids: list[int], compressed: bool = False) -> torch.Tensor:
    """transformers' logits [n, V] float64 of `folder` (compressed-tensors decompressed)."""
    extra = {}
    if compressed:
        from transformers import CompressedTensorsConfig

        extra["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double()


def runner(folder, **overrides) -> ModelRunner:
    args = {"model": str(folder), "max_total_tokens": 1024, "attention_backend": "torch"}
    return ModelRunner(ServerArgs(**{**args, **overrides}).executor)


def held_to_transformers(folder, ids, reference: torch.Tensor, name: str, exact_atol: float):
    """Our logits against transformers': through the C kernels within int4's gates
    (perplexity within 5%, top-1 >= 90%), and with the packed weights dequantized at each call
    (`--cpu-isa torch`'s path, switched on the same modules) within `exact_atol`."""
    packed = runner(folder)
    gates = QualityReference(None, ids, reference[:POSITIONS])
    ratio, agreement = quality_gates(gates, packed, name)
    assert abs(ratio - 1) <= 0.05
    assert agreement >= 0.90
    linears = [m for m in packed.model.modules() if isinstance(m, GroupedLinear | Int8Linear)]
    for m in linears:
        m.isa = Isa.TORCH
    gap = float((_logits(packed, ids) - reference[: len(ids) - 1]).abs().max())
    print(f"{name}: the dequantized path's largest logit gap {gap:.2e}")
    assert gap <= exact_atol
    return packed


def _logits(r: ModelRunner, ids: list[int]) -> torch.Tensor:
    from helpers import teacher_forced_logits

    return teacher_forced_logits(r, ids)[: len(ids) - 1]


def _oneshot(small_dir, out, recipe, calibrate: bool = False):
    """llm-compressor's one-shot of the small model, saved compressed to `out`."""
    from llmcompressor import oneshot

    model = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32)
    extra = {}
    if calibrate:
        from datasets import Dataset

        rows = torch.randint(
            3, 49152, (CALIBRATION, 64), generator=torch.Generator().manual_seed(0)
        )
        extra = {
            "dataset": Dataset.from_dict(
                {"input_ids": rows.tolist(), "attention_mask": [[1] * 64] * CALIBRATION}
            ),
            "num_calibration_samples": CALIBRATION,
            "max_seq_length": 64,
            "processor": AutoTokenizer.from_pretrained(small_dir),
        }
    oneshot(model=model, recipe=recipe, **extra)
    model.save_pretrained(out, save_compressed=True)
    copy_tokenizer(small_dir, out)
    return out


def _int_group(bits: int, group: int | None, symmetric: bool, strategy: str = "group") -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy}
    if group:
        weights["group_size"] = group
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


# K is 576 here, which llm-compressor refuses to cut into groups of 128: groups of 64
LLMCOMPRESSOR = {
    "w4a16-rtn": ("quantization", {"config_groups": _int_group(4, 64, True)}, 4),
    "w4a16-gptq-asym": (
        "gptq",
        {"config_groups": _int_group(4, 64, False), "actorder": "weight"},
        4,
    ),
    "w8a8": ("quantization", {"scheme": "W8A8"}, 8),
    "fp8": ("quantization", {"scheme": "FP8_DYNAMIC"}, 8),
}


@pytest.mark.parametrize("name", list(LLMCOMPRESSOR))
def test_llmcompressor_checkpoints_load_packed_within_the_gates(tmp_path, small_dir, ids, name):
    pytest.importorskip("llmcompressor", reason="needs llmcompressor (the dev extra)")
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    kind, settings, bits = LLMCOMPRESSOR[name]
    modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
    recipe = modifier(targets="Linear", ignore=["lm_head"], **settings)
    folder = _oneshot(small_dir, tmp_path / name, recipe, calibrate=kind == "gptq")
    reference = transformers_logits(folder, ids, compressed=True)
    # FP8 is requantized to int8 (1/254 of a row's largest value): not the exact path's
    atol = 1.0 if name == "fp8" else EXACT
    packed = held_to_transformers(folder, ids, reference, name, atol)
    kinds = GroupedLinear if bits == 4 else Int8Linear
    assert sum(isinstance(m, kinds) for m in packed.model.modules()) == 4 * LAYERS
    assert packed.quantization_path.startswith("compressed-tensors: ")


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
    tmp_path, small_dir, ids, method, group, symmetric, desc_act
):
    """GPTQ at group 128 on inputs of 576: the last group is 64 wide (AutoGPTQ's ceil)."""
    folder, float_folder = tmp_path / method, tmp_path / "dequantized"
    dequantized = write_quantized(small_dir, folder, method, group, symmetric, desc_act)
    write_dequantized(small_dir, float_folder, dequantized)
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


def _with_quant(tmp_path, small_dir, quant: dict):
    folder = tmp_path / "refused"
    folder.mkdir(exist_ok=True)
    config = json.loads((small_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return AutoConfig.from_pretrained(folder)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_W4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": _int_group(4, 128, True),
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
        ({**CT_W4, "config_groups": _int_group(4, 128, False, "tensor")}, "int tensor"),
        (
            {
                **CT_W4,
                "format": "int-quantized",
                "config_groups": _int_group(8, 0, False, "channel"),
            },
            "asymmetric",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(tmp_path, small_dir, quant, words):
    config = _with_quant(tmp_path, small_dir, quant)
    with pytest.raises(ValueError, match="^config.json: quantization_config") as refused:
        check_supported(config, None)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_act_orders_that_cannot_be_fused_and_requantizing_are_refused(tmp_path, small_dir):
    """q, k and v run as one linear: their inputs must fall in the same groups. And a
    pre-quantized checkpoint is not quantized again by --quantization."""
    folder = tmp_path / "gptq"
    write_quantized(small_dir, folder, "gptq", 64, True, desc_act=True)
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    weights[name] = weights[name].flip(0).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="act-order: .*k_proj groups its inputs unlike"):
        runner(folder)
    with pytest.raises(ValueError, match="already quantized"):
        runner(folder, quantization="int4")
