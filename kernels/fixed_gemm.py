"""Float32 matrix multiply whose every output is summed in one fixed order, whatever the number
of rows (`--enable-deterministic-inference`, CPU, AVX2): `x @ w.T`.

oneDNN and MKL pick their kernel, blocking and K-split by the number of rows M, so one row's
result moves in its last bits with the batch it is computed in, how much of its prompt came from
the cache (the prefill's M) and the prefill chunk size. Here output (m, n) is always one chain of
fused multiply-adds over k = 0, 1, ..., K - 1 from zero, in one 32-bit lane: weights are packed in
panels of 16 output rows interleaved by lane (`pack`: for each k, the 16 rows' weights side by
side), an activation x[m, k] is broadcast to every lane, and a register tile of up to 6 rows x 16
outputs holds twelve independent chains. Tiling over M and N, and which thread runs a panel,
change what runs together, never an output's order. The tile keeps prefill near oneDNN's speed
and a decode row reads each panel once.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from . import cpu_isa, native

PANEL = 16  # output rows of a panel: two AVX2 vectors

SOURCE = native.CSRC / "fixed_gemm.c"
SIGNATURES = (("fixed_linear", (native.POINTER,) * 3 + (native.INT64,) * 3),)


def _library() -> ctypes.CDLL | None:
    return native.load("fixed_gemm", SOURCE, SIGNATURES)


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2, a compiler to build it); builds it on first use."""
    return cpu_isa.Isa.AVX2 in cpu_isa.host_paths() and _library() is not None


@dataclass
class PackedPanels:
    """A float32 weight [N, K] in panels of 16 output rows, lane-interleaved: [ceil(N/16), K, 16]."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    panels_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.panels.is_contiguous() and self.panels.dtype == torch.float32
        self.panels_ptr = self.panels.data_ptr()

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedPanels:
        n, k = weight.shape
        padded = torch.zeros(-(-n // PANEL) * PANEL, k)
        padded[:n] = weight.detach()
        panels = padded.view(-1, PANEL, k).transpose(1, 2).contiguous()
        return cls(panels, n, k)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def unpack(self) -> torch.Tensor:
        """The float32 weight [N, K] this holds."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


def fixed_linear(x: torch.Tensor, w: PackedPanels) -> torch.Tensor:
    """x [M, K] float32 -> x @ w.T [M, N] float32, each output summed over k in order."""
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    native.built(_library()).fixed_linear(
        x.data_ptr(), w.panels_ptr, out.data_ptr(), m, w.out_features, w.in_features
    )
    return out
