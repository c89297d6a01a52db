"""CPU replacements for `nn.Linear`, swapped in after loading: float32 weights prepacked for
oneDNN (the default), weight-only int8 (`--quantization int8`) and grouped 4- or 8-bit weights
(`--quantization int4`, and GGUF's Q4_0/Q4_1/Q8_0 blocks kept packed: `gguf`).

`F.linear` on the CPU hands the weight to MKL, which repacks it on every call. For the few rows
of a decode step that repacking costs as much as the multiply: SmolLM2's 49k-row output
projection takes 21 ms for 4 rows that way and 6 ms prepacked on this kind of 2-core machine.
Prepacked results differ from `F.linear` only in float32 summation order.

Int8 weights are a quarter of the bytes, and a decode step at small batches is the time to read
the weights: `kernels/int8_gemm.py` says how they are multiplied. Int4 groups read 0.625
bytes a weight (`kernels/int4_gemm.py`). Neither is token-exact against float32; tests hold them
to quality gates (perplexity, top-1 agreement).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixrt.kernels import int4_gemm, int8_gemm
from radixrt.kernels.cpu_isa import Isa

BATCH_HINT = 32  # rows oneDNN tunes the layout for; any row count works
QUANTIZATIONS = ("int8", "int4", "gguf")
# bytes a weight reads, for the floors' counts (GGUF's Q8_0 tensors, 1.06, count as int4's)
BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.625, "gguf": 0.625}


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """Weight-only int8, symmetric, one scale per output channel; activations stay float.
    `isa` (`--cpu-isa`): the C kernel (avx2), or torch on the dequantized weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: Isa = Isa.AVX2):
        super().__init__()
        self.weight = int8_gemm.PackedInt8.quantize(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.isa = isa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.isa is Isa.TORCH:
            return _torch_linear(x, self.weight.dequantize(), self.bias)
        if x.dtype == torch.float32:
            return int8_gemm.int8_linear(x, self.weight, self.bias)
        return int8_gemm.int8_linear(x.float(), self.weight, self.bias).to(x.dtype)


class GroupedLinear(nn.Module):
    """Weight-only 4- or 8-bit groups of 32 inputs (`int4_gemm.PackedGroups`); activations stay
    float. Built from float weights (`quantize`, asymmetric) or from GGUF blocks as stored.
    `isa` (`--cpu-isa`): the C kernel (avx2), or torch on the weight dequantized at each call
    (no float copy is kept: the weights stay at their packed size on any path)."""

    def __init__(
        self, weight: int4_gemm.PackedGroups, bias: torch.Tensor | None, isa: Isa = Isa.AVX2
    ):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.isa = isa

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits=int4_gemm.Bits.INT4,
        isa: Isa = Isa.AVX2,
    ) -> GroupedLinear:
        return cls(int4_gemm.PackedGroups.quantize(weight, bits), bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.isa is Isa.TORCH:
            return _torch_linear(x, self.weight.dequantize(), self.bias)
        if x.dtype == torch.float32:
            return int4_gemm.grouped_linear(x, self.weight, self.bias)
        return int4_gemm.grouped_linear(x.float(), self.weight, self.bias).to(x.dtype)


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`--cpu-isa torch`: x @ weight.T + bias in float32, returned in x's dtype."""
    return torch.nn.functional.linear(x.float(), weight, bias).to(x.dtype)


def check_quantization(name: str | None, device: torch.device, isa: Isa | None) -> None:
    """Raise ValueError where `--quantization name` cannot run on `isa` (None: not a CPU)."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {list(QUANTIZATIONS)}")
    if device.type != "cpu" or isa is None:
        raise ValueError(f"{name} weights run on CPUs only")
    kernel = int8_gemm if name == "int8" else int4_gemm
    if isa is Isa.AVX2 and not kernel.available():
        raise ValueError(f"the {name} kernel did not build; --cpu-isa torch runs without it")


def replace_linears(
    model: nn.Module, kind: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> None:
    """Replace every `nn.Linear` in `model` by `kind(weight, bias)`, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, kind(child.weight, child.bias))
        else:
            replace_linears(child, kind)
