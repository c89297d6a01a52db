"""CPU replacements for `nn.Linear`, packed as the loader reads each weight (`LinearPacking`):
float32 weights prepacked for oneDNN (the default), weight-only int8 (`--quantization int8`) and
grouped weights (`--quantization int4`, and a GGUF's blocks kept packed at their own widths,
4 to 8 bits, or its F16/BF16 values at 16: `gguf`). On a CUDA GPU the quantized ones hold the same packed tensors, moved to the
device, and multiply them with the Triton kernel `kernels/packed_gemm.py` (isa None); its float
linears stay `nn.Linear`.

`F.linear` on the CPU hands the weight to MKL, which repacks it on every call. For the few rows
of a decode step that repacking costs as much as the multiply: SmolLM2's 49k-row output
projection takes 21 ms for 4 rows that way and 6 ms prepacked on this kind of 2-core machine.
Prepacked results differ from `F.linear` only in float32 summation order.

Int8 weights are a quarter of the bytes, and a decode step at small batches is the time to read
the weights: `kernels/int8_gemm.py` says how they are multiplied. Int4 groups read 0.625
bytes a weight (`kernels/int4_gemm.py`). Neither is token-exact against float32; tests hold them
to quality gates (perplexity, top-1 agreement).

Under `--enable-deterministic-inference` every linear is a `FixedOrderLinear`: each output is
summed in an order that does not depend on the number of rows (`kernels/fixed_gemm.py` for float
weights; the int8 and int4 kernels already sum each row alone: integer sums, then the same float
steps for any tile), and a row-parallel linear (`ROW_PARALLEL`: its inputs are what tensor
parallelism splits) is cut along its inputs into `FIXED_ORDER_SEGMENTS` consecutive parts, each
summed alone, the parts added pairwise: at `--tp-size 2` each rank holds one part and the
all-reduce adds the two, so the bits equal those at tp 1.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TypeAlias

import torch
from torch import nn

import radixrt.kernels as kernels
from radixrt.distributed.group import pairwise_sum
from radixrt.distributed.sharding import split_range
from radixrt.kernels import fixed_gemm, int4_gemm, int8_gemm
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.quantized import CheckpointQuant, PermutedGroups

BATCH_HINT = 32  # rows oneDNN tunes the layout for; any row count works
QUANTIZATIONS = ("int8", "int4", "gguf")
# bytes a weight reads, for the floors' counts (GGUF's Q8_0 tensors, 1.06, count as int4's)
BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.625, "gguf": 0.625}
# the linears whose inputs tensor parallelism splits over the ranks (an all-reduce sums them)
ROW_PARALLEL = ("o_proj", "down_proj")
# parts a row-parallel linear's inputs are summed in under the deterministic mode: tp 1 and 2
# give the same bits (each rank of 2 holds one part)
FIXED_ORDER_SEGMENTS = 2
EMBEDDING = "embed_tokens"  # the embedding table's module, packed like a linear where asked


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    # torch leaves mkldnn.is_available unannotated
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return device.type == "cpu" and dtype == torch.float32 and mkldnn


class PrepackedLinear(nn.Module):
    """A float32 weight in oneDNN's layout (`prepack`), multiplied by oneDNN."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def prepack(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PrepackedLinear:
        return cls(prepack(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.ops resolves its operators at run time: mypy sees Any
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


class Int8Linear(nn.Module):
    """Weight-only int8, symmetric, one scale per output channel; activations stay float.
    `isa` (`--cpu-isa`): the C kernel (avx512-vnni, avx-vnni, avx2), or torch on the
    dequantized weight; None: the Triton kernel (a GPU's path: `weight` and `bias` on x's
    device; the tests run it interpreted on the CPU)."""

    def __init__(
        self, weight: int8_gemm.PackedInt8, bias: torch.Tensor | None, isa: Isa | None = Isa.AVX2
    ):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.isa = isa

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, isa: Isa = Isa.AVX2
    ) -> Int8Linear:
        return cls(int8_gemm.PackedInt8.quantize(weight), bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.isa is None:
            out: torch.Tensor = kernels.packed_linear_fwd(x, self.weight, self.bias)
            return out
        if self.isa is Isa.TORCH:
            return _torch_linear(x, self.weight.dequantize(), self.bias)
        out = int8_gemm.int8_linear(x.float(), self.weight, self.bias, self.isa)
        return out.to(x.dtype)  # float32 x: `float` and `to` return x and out themselves


class GroupedLinear(nn.Module):
    """Weight-only groups of 32 inputs (`int4_gemm.PackedGroups`, 4 to 16 bits); activations stay
    float. Built from float weights (`quantize`, asymmetric), from GGUF blocks or from a
    pre-quantized checkpoint's groups as stored (`models/quantized.py`). `perm`: the order the
    weight takes its inputs in (GPTQ's act-order: sorted by group), gathered from the
    activations on every call; None: as given. `isa` (`--cpu-isa`): the C kernel (avx512-vnni,
    avx-vnni, avx2), or torch on the weight dequantized at each call; None: the Triton kernel
    (a GPU's path: `weight`, `bias` and `perm` on x's device; the tests run it interpreted on
    the CPU). No float copy is kept: the weights stay at their packed size on any path."""

    def __init__(
        self,
        weight: int4_gemm.PackedGroups,
        bias: torch.Tensor | None,
        isa: Isa | None = Isa.AVX2,
        perm: torch.Tensor | None = None,
    ):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.isa = isa
        self.perm = perm

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int4_gemm.Bits = int4_gemm.Bits.INT4,
        isa: Isa = Isa.AVX2,
    ) -> GroupedLinear:
        return cls(int4_gemm.PackedGroups.quantize(weight, bits), bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.isa is None:
            out: torch.Tensor = kernels.packed_linear_fwd(x, self.weight, self.bias)
            return out
        if self.isa is Isa.TORCH:
            return _torch_linear(x, self.weight.dequantize(), self.bias)
        out = int4_gemm.grouped_linear(x.float(), self.weight, self.bias, self.isa)
        return out.to(x.dtype)  # float32 x: `float` and `to` return x and out themselves


class PanelLinear(nn.Module):
    """A float32 weight in fixed-order panels (`fixed_gemm`), no bias: a part of a
    `FixedOrderLinear`."""

    def __init__(self, weight: fixed_gemm.PackedPanels):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = fixed_gemm.fixed_linear(x.float(), self.weight)
        return out.to(x.dtype)


class FixedOrderLinear(nn.Module):
    """A linear whose outputs are bitwise independent of the rows computed beside them
    (`--enable-deterministic-inference`): `parts` (bias-free, each over consecutive inputs,
    each summing a row alone) added pairwise, (p0 + p1) + (p2 + p3), then the bias. Its parts
    are not submodules: the model's linear counts see one linear."""

    def __init__(self, parts: tuple[nn.Module, ...], bias: torch.Tensor | None):
        super().__init__()
        self.parts = parts
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            out: torch.Tensor = self.parts[0](x)
        else:
            out = pairwise_sum([part(x[:, lo:hi]) for part, (lo, hi) in self.spans()])
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def spans(self) -> list[tuple[nn.Module, tuple[int, int]]]:
        """Each part with the inputs [lo, hi) it takes."""
        spans, lo = [], 0
        for part in self.parts:
            width = features(part)
            assert width is not None
            spans.append((part, (lo, lo + width[1])))
            lo += width[1]
        return spans

    @property
    def nbytes(self) -> int:
        return sum(_part_bytes(p) for p in self.parts)


def _part_bytes(part: nn.Module) -> int:
    if isinstance(part, Int8Linear):
        nbytes: int = part.weight.tiles.nbytes + part.weight.scales.nbytes
        return nbytes
    weight = part.weight
    assert isinstance(weight, fixed_gemm.PackedPanels | int4_gemm.PackedGroups)
    nbytes = weight.nbytes
    return nbytes


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`--cpu-isa torch`: x @ weight.T + bias in float32, returned in x's dtype."""
    return torch.nn.functional.linear(x.float(), weight, bias).to(x.dtype)


def check_quantization(name: str | None, device: torch.device, isa: Isa | None) -> None:
    """Raise ValueError where `--quantization name` cannot run on `device`: on a CPU, on `isa`'s
    kernels; on a CUDA GPU each runs on the Triton kernel, in any of the run's dtypes."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {list(QUANTIZATIONS)}")
    if device.type == "cuda":
        return
    if device.type != "cpu" or isa is None:
        raise ValueError(f"{name} weights run on CPUs and CUDA GPUs only")
    kernel = int8_gemm if name == "int8" else int4_gemm
    if isa is not Isa.TORCH and not kernel.available(isa):
        raise ValueError(f"the {name} kernel did not build; --cpu-isa torch runs without it")


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An `nn.Linear` holding `weight` [N, K] itself and a copy of `bias`, on their device and
    in their dtype."""
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return linear


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] in oneDNN's layout for `BATCH_HINT` rows (a copy)."""
    # torch.ops resolves its operators at run time: mypy sees Any
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    return packed


def features(module: nn.Module) -> tuple[int, int] | None:
    """(out, in) features of a linear, float, prepacked or quantized; None for another module."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if isinstance(module, GroupedLinear | Int8Linear):
        return module.weight.out_features, module.weight.in_features
    if isinstance(module, PrepackedLinear):
        out, in_ = module.packed.shape
        return out, in_
    if isinstance(module, PanelLinear):
        return module.weight.out_features, module.weight.in_features
    if isinstance(module, FixedOrderLinear):  # its parts side by side along the inputs
        out, in_ = 0, 0
        for part in module.parts:
            width = features(part)
            assert width is not None  # every part is a linear
            out, in_ = width[0], in_ + width[1]
        return out, in_
    return None


@dataclass(frozen=True)
class Segments:
    """A weight packed for `FixedOrderLinear`: its inputs cut into consecutive parts, each
    packed alone."""

    parts: tuple[int8_gemm.PackedInt8 | int4_gemm.PackedGroups | fixed_gemm.PackedPanels, ...]


Packed: TypeAlias = (
    int8_gemm.PackedInt8 | int4_gemm.PackedGroups | PermutedGroups | torch.Tensor | Segments
)


@dataclass(frozen=True)
class LinearPacking:
    """What a CPU run makes of its `nn.Linear`s: int8 (`Int8Linear`), int4 (`GroupedLinear`;
    the output projection `lm_head` in 8-bit groups, as llama.cpp keeps it above 4 bits: in 4
    bits it alone failed the quality gates), or float32 prepacked for oneDNN (`quantization`
    None, or `gguf` for what its file does not hold packed); with `deterministic`, each as a
    `FixedOrderLinear` (float32 in fixed-order panels), a row-parallel one in
    `FIXED_ORDER_SEGMENTS // tp_size` parts. The loader calls `pack` on each
    float weight as it is read, so that the float copy of the model never exists whole, and
    `module` once the biases are in; `replace` does both to the linears left (a tied output
    projection, whose float weight is the embedding's). A pre-quantized checkpoint's linears
    (`checkpoint`) are read packed instead (`CheckpointQuant.read`); its float ones (an output
    projection it left float) are prepacked. On a CUDA GPU (`isa` None) the packed weights are
    made the same way, on the CPU, and moved to `device` for the Triton kernel; float ones
    stay `nn.Linear`s in the run's dtype."""

    quantization: str | None
    isa: Isa | None
    _: KW_ONLY
    device: torch.device = torch.device("cpu")
    checkpoint: CheckpointQuant | None = None
    deterministic: bool = False
    tp_size: int = 1

    @classmethod
    def of(
        cls,
        quantization: str | None,
        device: torch.device,
        dtype: torch.dtype,
        isa: Isa | None,
        deterministic: bool = False,
        tp_size: int = 1,
    ) -> LinearPacking | None:
        """The run's packing (`isa`: the CPU's path, None on a CUDA GPU); None where the
        linears stay `nn.Linear` (float weights on a GPU, or ones oneDNN cannot prepack)."""
        if quantization in ("int8", "int4"):
            return cls(
                quantization, isa, device=device, deterministic=deterministic, tp_size=tp_size
            )
        if prepack_available(device, dtype):
            return cls(None, isa or Isa.AVX2, deterministic=deterministic, tp_size=tp_size)
        return None

    @property
    def packs_embedding(self) -> bool:
        """Whether the embedding table (`EMBEDDING`) is packed as it is read too: under int4, in
        8-bit groups (a tied output projection multiplies by the same groups), so no float copy
        of it is held (`models.layers.PackedEmbedding`). Not under the deterministic mode, whose
        linears are fixed-order parts."""
        return self.quantization == "int4" and not self.deterministic

    def pack(self, name: str, weight: torch.Tensor) -> Packed:
        """`weight` [N, K] of the linear `name` (as `named_modules` names it) in its packed
        form; it holds no reference to `weight`."""
        if self.deterministic:
            return self._segments(name, weight)
        return self._pack_one(name, weight)

    def _pack_one(self, name: str, weight: torch.Tensor) -> Packed:
        if self.deterministic and self.quantization is None:
            return fixed_gemm.PackedPanels.pack(weight)
        if self.quantization == "int8":
            return int8_gemm.PackedInt8.quantize(weight)
        if self.quantization == "int4":
            bits = int4_gemm.Bits.INT8 if name in ("lm_head", EMBEDDING) else int4_gemm.Bits.INT4
            return int4_gemm.PackedGroups.quantize(weight, bits)
        if self.isa is None:  # a GPU's float linear: its weight as read, for an `nn.Linear`
            return weight.clone()
        return prepack(weight)

    def _segments(self, name: str, weight: torch.Tensor) -> Segments:
        """`weight` cut along its inputs: a row-parallel linear into this rank's share of
        `FIXED_ORDER_SEGMENTS` parts, any other whole."""
        row_parallel = name.rpartition(".")[2] in ROW_PARALLEL
        n = max(1, FIXED_ORDER_SEGMENTS // self.tp_size) if row_parallel else 1
        k = weight.shape[1]
        spans = [split_range(k, n, s) for s in range(n)]
        return Segments(tuple(self._pack_one(name, weight[:, lo:hi]) for lo, hi in spans))

    def module(self, packed: Packed, bias: torch.Tensor | None) -> nn.Module:
        """The module that serves a packed weight with `bias` (copied)."""
        if isinstance(packed, Segments):
            parts = tuple(self.module(p, None) for p in packed.parts)
            return FixedOrderLinear(parts, bias)
        if isinstance(packed, fixed_gemm.PackedPanels):
            return PanelLinear(packed)
        if isinstance(packed, int8_gemm.PackedInt8):
            return Int8Linear(packed.to(self.device), bias, self.isa)
        if isinstance(packed, int4_gemm.PackedGroups):
            return GroupedLinear(packed.to(self.device), bias, self.isa)
        if isinstance(packed, PermutedGroups):
            on_device = packed.to(self.device)
            return GroupedLinear(on_device.weight, bias, self.isa, on_device.perm)
        if self.isa is None:
            return float_linear(packed, bias)
        return PrepackedLinear(packed, bias)

    def replace(self, model: nn.Module) -> None:
        """Replace every `nn.Linear` left in `model` by its packed module, in place."""
        for name, linear in list(model.named_modules()):
            if isinstance(linear, nn.Linear):
                parent, _, child = name.rpartition(".")
                packed = self.pack(name, linear.weight)
                setattr(model.get_submodule(parent), child, self.module(packed, linear.bias))
