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
    """Weight-only int8, symmetric, one scale per output channel; activations stay float."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = int8_gemm.PackedInt8.quantize(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return int8_gemm.int8_linear(x, self.weight, self.bias)
        return int8_gemm.int8_linear(x.float(), self.weight, self.bias).to(x.dtype)


class GroupedLinear(nn.Module):
    """Weight-only 4- or 8-bit groups of 32 inputs (`int4_gemm.PackedGroups`); activations stay
    float. Built from float weights (`quantize`, asymmetric) or from GGUF blocks as stored."""

    def __init__(self, weight: int4_gemm.PackedGroups, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, bits=int4_gemm.Bits.INT4
    ) -> GroupedLinear:
        return cls(int4_gemm.PackedGroups.quantize(weight, bits), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return int4_gemm.grouped_linear(x, self.weight, self.bias)
        return int4_gemm.grouped_linear(x.float(), self.weight, self.bias).to(x.dtype)


def check_quantization(name: str | None, device: torch.device) -> None:
    """Raise ValueError where `--quantization name` cannot run."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {list(QUANTIZATIONS)}")
    kernel = int8_gemm if name == "int8" else int4_gemm
    if device.type != "cpu" or not kernel.available():
        raise ValueError(f"{name} weights run on CPUs with AVX2 and a C compiler only")


def replace_linears(
    model: nn.Module, kind: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> None:
    """Replace every `nn.Linear` in `model` by `kind(weight, bias)`, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, kind(child.weight, child.bias))
        else:
            replace_linears(child, kind)
