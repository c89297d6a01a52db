"""Pre-quantized checkpoints served packed (`models/quantized.py`): compressed-tensors ones
written by llm-compressor's one-shot (W4A16 by round-to-nearest and by GPTQ, W8A8, FP8) of a
small trained model (the default model's first layers), held against transformers' own
loading of the same checkpoint (compressed-tensors decompresses it): with the weights
dequantized at each call (`--cpu-isa torch`) within float16's rounding (FP8, requantized to
int8 per channel, within int8's); through the C kernels within int4's quality gates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixrt.kernels import int4_gemm
from radixrt.models.linear import GroupedLinear, Int8Linear

from quant_packers import (
    EXACT,
    LAYERS,
    copy_tokenizer,
    ct_int_group,
    held_to_transformers,
    quality_ids,
    transformers_logits,
)

pytest.importorskip("llmcompressor", reason="needs llm-compressor (make .venv installs it)")

pytestmark = [
    pytest.mark.skipif(not int4_gemm.available(), reason="packed weights need AVX2 and a compiler"),
    pytest.mark.model,  # the default model's first layers
]
CALIBRATION = 8  # sequences of 64 tokens GPTQ sees


@pytest.fixture(scope="module")
def ids(small_model_dir) -> list[int]:
    return quality_ids(small_model_dir)


def _oneshot(small_model_dir, out, recipe, calibrate: bool = False):
    """llm-compressor's one-shot of the small model, saved compressed to `out`."""
    from llmcompressor import oneshot

    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32)
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
            "processor": AutoTokenizer.from_pretrained(small_model_dir),
        }
    oneshot(model=model, recipe=recipe, **extra)
    model.save_pretrained(out, save_compressed=True)
    copy_tokenizer(small_model_dir, out)
    return out


LLMCOMPRESSOR = {
    "w4a16-rtn": ("quantization", {"config_groups": ct_int_group(4, 64, True)}, 4),
    "w4a16-gptq-asym": (
        "gptq",
        {"config_groups": ct_int_group(4, 64, False), "actorder": "weight"},
        4,
    ),
    "w8a8": ("quantization", {"scheme": "W8A8"}, 8),
    "fp8": ("quantization", {"scheme": "FP8_DYNAMIC"}, 8),
}


@pytest.mark.parametrize("name", list(LLMCOMPRESSOR))
def test_llmcompressor_checkpoints_load_packed_within_the_gates(
    tmp_path, small_model_dir, ids, name
):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    kind, settings, bits = LLMCOMPRESSOR[name]
    modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
    recipe = modifier(targets="Linear", ignore=["lm_head"], **settings)
    folder = _oneshot(small_model_dir, tmp_path / name, recipe, calibrate=kind == "gptq")
    reference = transformers_logits(folder, ids, compressed=True)
    # FP8 is requantized to int8 (1/254 of a row's largest value): not the exact path's
    atol = 1.0 if name == "fp8" else EXACT
    packed = held_to_transformers(folder, ids, reference, name, atol)
    kinds = GroupedLinear if bits == 4 else Int8Linear
    assert sum(isinstance(m, kinds) for m in packed.model.modules()) == 4 * LAYERS
    assert packed.quantization_path.startswith("compressed-tensors: ")
