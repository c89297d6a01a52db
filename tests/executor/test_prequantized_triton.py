"""Pre-quantized checkpoints on the GPU's path, run on the CPU: the tiny model's GPTQ (act-order)
and AWQ checkpoints (`quant_packers.py`, their published layouts) loaded as a CUDA run loads
them (`LinearPacking` with no CPU path: the packed weights moved to the run's device, the float
linears kept `nn.Linear`) and multiplied by the Triton kernel (`kernels/packed_gemm.py`) under
Triton's interpreter. Its logits are the dequantized weights' (`--cpu-isa torch`'s path: float
activations, as the kernel's) to float32 rounding, and its top tokens the C kernels' (8-bit
activations) at the quality gates' rate."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from radixrt.executor.model_loader import load_model
from radixrt.kernels import int4_gemm
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.linear import GroupedLinear, LinearPacking

from helpers import teacher_forced_logits
from quant_packers import quality_ids, runner, write_quantized

pytestmark = pytest.mark.skipif(
    not int4_gemm.available(), reason="the C path compared with needs AVX2 and a compiler"
)
TOP1_POSITIONS = 64
IDS = [1, 504, 3458, 282, 4649, 314, 253, 1345, 6004, 30, 378, 17, 9, 3500, 40000, 2]


@dataclass(frozen=True)
class Paths:
    """A checkpoint's teacher-forced logits [n, V] by path."""

    triton: torch.Tensor
    dequantized: torch.Tensor  # `--cpu-isa torch`: the packed weights dequantized, float32
    c_kernels: torch.Tensor  # 8-bit activations

    def gap(self) -> float:
        """The Triton path's largest gap to the dequantized one, over the largest logit."""
        return float((self.triton - self.dequantized).abs().max() / self.dequantized.abs().max())


def _paths(folder, ids: list[int], desc_act: bool) -> Paths:
    """The checkpoint in `folder` loaded as a CUDA run loads it and run through the Triton
    kernel, then dequantized, and loaded for the CPU's C kernels."""
    run = runner(folder)
    c_kernels = teacher_forced_logits(run, ids)
    gpu = LinearPacking(None, None, checkpoint=run.checkpoint_quant)
    run.model = load_model(
        run.model_path, run.config, run.context_length, run.tp, run.dtype, packing=gpu
    )
    linears = [m for m in run.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * 2 and all(m.isa is None for m in linears)
    assert all((m.perm is not None) == desc_act for m in linears)
    triton_path = teacher_forced_logits(run, ids)
    for m in linears:
        m.isa = Isa.TORCH
    paths = Paths(triton_path, teacher_forced_logits(run, ids), c_kernels)
    print(f"{folder.name}: relative gap to the dequantized path {paths.gap():.1e}")
    return paths


@pytest.mark.parametrize(
    "method, group, symmetric, desc_act",
    [("gptq", 32, True, True), ("awq", 64, False, False)],
)
def test_checkpoint_through_the_triton_kernel_equals_its_dequantized_weights(
    tmp_path, tiny_model_dir, method, group, symmetric, desc_act
):
    """The tiny random model: float32 sums in another order, through two layers."""
    folder = tmp_path / method
    write_quantized(tiny_model_dir, folder, method, group, symmetric, desc_act)
    assert _paths(folder, IDS, desc_act).gap() <= 1e-4


@pytest.mark.model
def test_checkpoint_through_the_triton_kernel_agrees_with_the_c_kernels(tmp_path, small_model_dir):
    """The default model's first layers, GPTQ g128 on inputs of 576 (the last group 64 wide):
    the dequantized path's logits to float32 rounding, and the C kernels' top token (their
    8-bit activations move logits of about 20 by up to 2, so no tighter) at >= 90% of the
    quality text's first positions."""
    folder = tmp_path / "gptq"
    write_quantized(small_model_dir, folder, "gptq", 128, True)
    paths = _paths(folder, quality_ids(small_model_dir)[:TOP1_POSITIONS], False)
    assert paths.gap() <= 1e-4
    agree = (paths.triton.argmax(-1) == paths.c_kernels.argmax(-1)).double().mean()
    print(f"top-1 agreement with the C kernels {float(agree):.3f}")
    assert agree >= 0.9


def test_a_checkpoints_float_linears_stay_nn_linear_on_a_gpu():
    """A linear the checkpoint left float (`ignore`, `modules_to_not_convert`), packed for a
    GPU: an `nn.Linear` holding the weight as read (the run's dtype and device), its bias
    copied."""
    packing = LinearPacking(None, None)
    g = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(*s, generator=g) for s in ((24, 40), (24,), (3, 40)))
    module = packing.module(packing.pack("lm_head", weight), bias)
    assert type(module) is nn.Linear and module.weight.data_ptr() != weight.data_ptr()
    assert torch.equal(module(x), torch.nn.functional.linear(x, weight, bias))
