"""Weight-only int8 matrix multiply for the CPU (AVX2; AVX-512 VNNI): `x @ (w * scale).T + bias`.

Weights are int8, symmetric, one scale per output channel. Each activation row is quantized on
the fly to int16 with its own scale (relative error about 1.5e-5 of the row's largest value, far
below the weights' own rounding), so the products run on integer multiply-adds (`vpmaddwd`: 16
per instruction) instead of converting every weight to float.

Why a kernel of our own: the int8 routes torch offers on this kind of CPU were slower than
float32 or failed the quality gates (docs/benchmarks/history.md, "int8 weights: the candidates measured"). What makes a decode
step fast is reading the weights at the memory's speed, so they are packed once into tiles of
4 output rows x 32 inputs, laid out in the order the kernel reads them: one sequential stream per
thread. A tile stays in L1 while every block of 3 activation rows passes over it, so prefill
chunks reuse it from cache too.

Int32 sums cannot overflow: |x| <= 32767, |w| <= 127 and at most 2,048 inputs are summed in int32
before being added to a float accumulator.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace

import torch

from . import cpu_isa, native

ROWS, DEPTH = 4, 32  # a tile: output rows x inputs
QUANTIZE_BYTES = 4 << 20  # float weights `PackedInt8.quantize` rounds at a time

SOURCE = native.CSRC / "int8_gemm.c"
P, I = native.POINTER, native.INT64
SIGNATURES = (("int8_linear", (P,) * 7 + (I,) * 4),)


def _library(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2) -> ctypes.CDLL | None:
    return native.load(f"int8_gemm-{isa.value}", SOURCE, SIGNATURES, isa.cflags)


def available(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2) -> bool:
    """Whether this CPU runs the kernel on `isa` (the CPU has it, a compiler builds it);
    builds it on first use."""
    return isa in cpu_isa.host_paths() and _library(isa) is not None


@dataclass
class PackedInt8:
    """A weight [N, K] as int8 tiles and per-output-channel float scales; the kernel's
    arguments that never change are read once here rather than on every call."""

    tiles: torch.Tensor  # int8 [ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32
    scales: torch.Tensor  # float32 [N]
    out_features: int
    in_features: int
    padded_in_features: int = field(init=False)  # Kp
    tiles_ptr: int = field(init=False)
    scales_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.tiles.is_contiguous() and self.scales.is_contiguous()
        self.padded_in_features = self.tiles.shape[1] * DEPTH
        self.tiles_ptr, self.scales_ptr = self.tiles.data_ptr(), self.scales.data_ptr()

    def to(self, device: torch.device) -> PackedInt8:
        """The same packing on `device` (a GPU's Triton kernel reads it as stored)."""
        return replace(self, tiles=self.tiles.to(device), scales=self.scales.to(device))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> PackedInt8:
        """Symmetric per-channel rounding: w ~= q * scale with q in [-127, 127]. Rows are
        rounded and packed `QUANTIZE_BYTES` of float at a time, straight into the result (rows
        round independently: the same result as in one pass, with small temporaries), on the
        CPU, wherever `weight` lies."""
        n, k = weight.shape
        kp = -(-k // DEPTH) * DEPTH
        tiles = torch.empty(-(-n // ROWS), kp // DEPTH, ROWS, DEPTH, dtype=torch.int8)
        scales = torch.empty(n)
        step = max(1, QUANTIZE_BYTES // (kp * 4 * ROWS)) * ROWS
        for start in range(0, n, step):
            w = weight[start : start + step].detach().to("cpu", torch.float32)
            part = scales[start : start + step]
            torch.clamp_min(w.abs().amax(dim=1) / 127, torch.finfo(torch.float32).tiny, out=part)
            q = torch.round(w / part[:, None]).clamp_(-127, 127).to(torch.int8)
            packed = pack(q)
            tiles[start // ROWS : start // ROWS + packed.shape[0]] = packed
        return cls(tiles, scales, n, k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        q = self.tiles.permute(0, 2, 1, 3).reshape(-1, self.padded_in_features)
        return q[: self.out_features, : self.in_features].float() * self.scales[:, None]


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> tiles [ceil(N/4), Kp/32, 4, 32], zero-padded, in the kernel's read order."""
    n, k = q.shape
    np_, kp = -(-n // ROWS) * ROWS, -(-k // DEPTH) * DEPTH
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = q
    return padded.view(np_ // ROWS, ROWS, kp // DEPTH, DEPTH).transpose(1, 2).contiguous()


def int8_linear(
    x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None, isa: cpu_isa.Isa = cpu_isa.Isa.AVX2
) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32, on `isa`'s kernel (every path gives the same
    bits). Lean on purpose: at batch 1 this wrapper's own microseconds, times four linears a
    layer, are a visible share of a decode step."""
    x = x.contiguous()
    m, kp = x.shape[0], w.padded_in_features
    xq = torch.empty(m, kp, dtype=torch.int16)
    xs = torch.empty(m, dtype=torch.float32)
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    native.built(_library(isa)).int8_linear(
        x.data_ptr(),
        xq.data_ptr(),
        xs.data_ptr(),
        w.tiles_ptr,
        w.scales_ptr,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        w.out_features,
        w.in_features,
        kp,
    )
    return out
