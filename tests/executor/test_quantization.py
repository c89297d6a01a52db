"""`--quantization int8|int4|gguf` against float32 on the same weights: not token-exact, so held
to quality gates on a fixed text shipped with the tests (teacher-forced, 500 positions): int8's
perplexity within 2% of float32's and its top-1 token the same as float32's at >= 95% of the
positions; int4's (the default model's own Q4_1 blocks) within 5% and >= 90%."""

from __future__ import annotations

import pytest
import torch

from radixrt.config import ServerArgs
from radixrt.executor.model_loader import load_model
from radixrt.executor.model_runner import ModelRunner, linear_bytes
from radixrt.kernels import int4_gemm, int8_gemm
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.layers import PackedEmbedding
from radixrt.models.linear import (
    QUANTIZATIONS,
    GroupedLinear,
    Int8Linear,
    LinearPacking,
    check_quantization,
)

from helpers import quality_gates, teacher_forced_logits

pytestmark = [
    pytest.mark.skipif(not int8_gemm.available(), reason="int8 needs AVX2 and a compiler"),
    pytest.mark.model,  # the default model
]


def test_int8_weights_pass_the_quality_gates(quality_reference):
    runner = ModelRunner(ServerArgs(max_total_tokens=1024, quantization="int8").executor)
    assert sum(isinstance(m, Int8Linear) for m in runner.model.modules()) == 4 * 30 + 1
    assert runner.weights.weight_bytes * 4 == quality_reference.runner.weights.weight_bytes
    ratio, agreement = quality_gates(quality_reference, runner, "int8")
    assert abs(ratio - 1) <= 0.02
    assert agreement >= 0.95


needs_int4 = pytest.mark.skipif(not int4_gemm.available(), reason="int4 needs AVX2 and a compiler")


@pytest.fixture(scope="module")
def int4_runner() -> ModelRunner:
    if not int4_gemm.available():
        pytest.skip("int4 needs AVX2 and a compiler")
    return ModelRunner(ServerArgs(max_total_tokens=1024, quantization="int4").executor)


def test_int4_weights_pass_the_quality_gates(quality_reference, int4_runner):
    """The default model under `int4` serves its GGUF's own blocks: Q4_1 linears, the Q8_0
    embedding as the output projection (quantizing its float copy again would give the same
    Q4_1 grid back, so this is also what int4 from float weights scores here)."""
    linears = [m for m in int4_runner.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * 30 + 1
    assert int4_runner.model.lm_head.weight.bits == int4_gemm.Bits.INT8
    # tokens are looked up in the output projection's Q8_0 groups: the float table's values
    table, floats = int4_runner.model.embed_tokens, quality_reference.runner.model.embed_tokens
    assert isinstance(table, PackedEmbedding) and table.weight is int4_runner.model.lm_head.weight
    ids = torch.tensor(quality_reference.ids[:64])
    assert torch.equal(table(ids), floats(ids))
    assert linear_bytes(int4_runner.model) < linear_bytes(quality_reference.runner.model) / 5
    ratio, agreement = quality_gates(quality_reference, int4_runner, "int4")
    assert abs(ratio - 1) <= 0.05
    assert agreement >= 0.90


@needs_int4
def test_int4_quantizes_float_weights_where_no_gguf_holds_them(tiny_model_dir):
    """A model folder of float weights: every linear in 4-bit groups, the output projection
    in 8-bit ones (how close they come is the kernel tests' matter and, on a real model, the
    gates': this random model's wide weights amplify any rounding), and a forward runs."""
    args = ServerArgs(model=str(tiny_model_dir), max_total_tokens=256, quantization="int4")
    runner = ModelRunner(args.executor)
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * runner.config.num_hidden_layers + 1
    assert runner.model.lm_head.weight.bits == int4_gemm.Bits.INT8
    assert all(m.weight.bits == int4_gemm.Bits.INT4 for m in linears[:-1])
    assert isinstance(runner.model.embed_tokens, PackedEmbedding)
    logits = teacher_forced_logits(runner, list(range(5, 45)))
    assert logits.shape == (40, runner.vocab_size) and torch.isfinite(logits).all()


@needs_int4
@pytest.mark.parametrize(
    "name, dtype, rtol",
    [("int4", "float32", 1e-4), ("int8", "float32", 1e-4), ("int4", "float16", 5e-3)],
)
def test_quantized_linears_packed_for_a_gpu_run_the_triton_kernel(
    tiny_model_dir, name, dtype, rtol
):
    """`--quantization` packed as a CUDA run packs it (`LinearPacking` with no CPU path), on the
    CPU under Triton's interpreter: every linear, the tied output projection too (int4: in
    8-bit groups, shared with the packed embedding table), on the Triton kernel, its logits the
    dequantized weights' (`--cpu-isa torch`'s path) to float32 rounding through this random
    model's two layers; in float16 (a GPU's half precision: bf16 stands in badly under the
    interpreter) to float16's, with the table's rows looked up in float16."""
    args = ServerArgs(
        model=str(tiny_model_dir), max_total_tokens=256, quantization=name, dtype=dtype
    )
    runner = ModelRunner(args.executor)
    packing = LinearPacking(name, None)
    runner.model = load_model(
        runner.model_path,
        runner.config,
        runner.context_length,
        runner.tp,
        runner.dtype,
        packing=packing,
    )
    packing.replace(runner.model)
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear | Int8Linear)]
    assert len(linears) == 4 * runner.config.num_hidden_layers + 1
    assert all(m.isa is None for m in linears)
    ids = list(range(5, 45))
    if name == "int4":
        assert runner.model.embed_tokens.rows(torch.tensor([3])).dtype == runner.dtype
    triton_path = teacher_forced_logits(runner, ids)
    for m in linears:
        m.isa = Isa.TORCH
    dequantized = teacher_forced_logits(runner, ids)
    gap = (triton_path - dequantized).abs().max() / dequantized.abs().max()
    print(f"{name} {dtype}: relative gap {float(gap):.1e}")
    assert gap <= rtol


def test_quantization_is_refused_where_it_cannot_run(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="int8 weights run on CPUs and CUDA GPUs only"):
        ModelRunner(ServerArgs(device="meta", quantization="int8").executor)
    for name in QUANTIZATIONS:  # a CUDA GPU runs each on the Triton kernel (no CPU path)
        check_quantization(name, torch.device("cuda"), None)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        ModelRunner(ServerArgs(model=str(tiny_model_dir), quantization="gguf").executor)
