"""A decode step's decoder layers in one native call (CPU, float32 activations, grouped weights of
any `int4_gemm` width, 16-bit ones included, or int8 channels): per layer, norm -> qkv -> RoPE
and the K/V store -> paged attention -> o and the residual -> norm -> gate_up -> SiLU -> down,
every layer of the step inside one OpenMP parallel region, a barrier between stages, the scratch
allocated once per step.

Why: a decode step of a small model is mostly structure, not arithmetic. Per layer the Python
path makes nine ctypes calls, about twenty `torch.empty` and as many OpenMP regions, each region
ending in a barrier; at one stream of the default model that was half of the step. Here Python
runs once per step, and the threads stay in one region, so another process's load on a core
delays a barrier, not the start of each of ~100 regions.

The stages are the very code of the separate kernels, built into this one library
(`csrc/cpu_layer.c` #includes their `.c` files): the grouped GEMMs' bodies (`int4_gemm`,
`int8_gemm`), the paged decode's body (`cpu_paged`) and the glue's rows (`cpu_fused`, their
products unfused as there), so a layer here gives the bits of the per-op path; `tests/kernels/test_cpu_layer.py` holds it to that. `--cpu-isa` picks the build, as for
the GEMM.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_isa, cpu_paged, int4_gemm, int8_gemm, native

SOURCE = native.CSRC / "cpu_layer.c"
P, I = native.POINTER, native.INT64
SIGNATURES = (("decode_layers", (P, I, P, P, P)),)


INT8_CHANNELS = 1  # Packed.kind of an `int8_gemm.PackedInt8` (the others: `int4_gemm.Bits`)
Weight = int4_gemm.PackedGroups | int8_gemm.PackedInt8


class Packed(ctypes.Structure):
    _fields_ = [("w", P), ("sc", P), ("N", I), ("K", I), ("G", I), ("kind", I), ("offs", I)]

    @classmethod
    def of(cls, w: Weight) -> Packed:
        if isinstance(w, int8_gemm.PackedInt8):
            groups, kind, offs = w.padded_in_features // int4_gemm.GROUP, INT8_CHANNELS, 0
        else:
            groups, kind, offs = w.groups, int(w.bits), int(w.offsets)
        return cls(w.tiles_ptr, w.scales_ptr, w.out_features, w.in_features, groups, kind, offs)


class Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", P),
        ("norm2", P),
        ("qkv", Packed),
        ("o", Packed),
        ("gate_up", Packed),
        ("down", Packed),
        ("k_buf", P),
        ("v_buf", P),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        *((name, I) for name in ("T", "H", "Hq", "Hkv", "D", "I", "L", "splits")),
        ("eps", native.FLOAT),
        ("scale", native.FLOAT),
        *((name, P) for name in ("cos", "sin", "out_slots", "slots", "lens")),
        *((name, P) for name in ("h", "qkv", "q", "attn", "lse", "part", "o", "gate_up", "act")),
        ("xs", P),
        ("xsum", P),
        ("a", P),
    ]


def _library(isa: cpu_isa.Isa) -> ctypes.CDLL | None:
    return native.load(f"cpu_layer-{isa.value}", SOURCE, SIGNATURES, isa.cflags)


def available(isa: cpu_isa.Isa) -> bool:
    """Whether this CPU runs the layer kernel on `isa` (builds it on first use)."""
    return (
        isa in cpu_isa.host_paths() and isa is not cpu_isa.Isa.TORCH and _library(isa) is not None
    )


@dataclass(frozen=True)
class Shape:
    """A model's layer shape: hidden size, query and KV heads, head size, intermediate size,
    and the norms' epsilon."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


def layer_of(
    norms: tuple[torch.Tensor, torch.Tensor],
    linears: tuple[Weight, ...],
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
) -> Layer:
    """A layer's record: its norms' weights, its qkv, o, gate_up and down weights, and its
    float32 pool buffers (the caller keeps them all alive)."""
    assert all(n.is_contiguous() and n.dtype == torch.float32 for n in norms)
    assert k_buf.dtype == v_buf.dtype == torch.float32 and k_buf.is_contiguous()
    return Layer(
        norms[0].data_ptr(),
        norms[1].data_ptr(),
        *(Packed.of(w) for w in linears),
        k_buf.data_ptr(),
        v_buf.data_ptr(),
    )


def decode_layers(
    layers: ctypes.Array[Layer],
    shape: Shape,
    x: torch.Tensor,
    residual: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_slots: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    isa: cpu_isa.Isa,
) -> None:
    """Every layer of `layers` over x and residual [T, H] float32, in place: x becomes the last
    layer's MLP output, residual the stream (the per-op path's pair). Row t is a decode row: its
    position's cos, sin [T, D], its new K/V stored at out_slots[t], and its keys slots[t,
    :lens[t]] (int64, the new one among them)."""
    t, h = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and x.dtype == torch.float32
    d, hq, hkv, inter = shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate
    slots, lens, out_slots = slots.contiguous(), lens.contiguous(), out_slots.contiguous()
    assert slots.dtype == lens.dtype == out_slots.dtype == torch.int64
    assert cos.shape == sin.shape == (t, d) and out_slots.shape == lens.shape == (t,)
    cos, sin = cos.contiguous(), sin.contiguous()
    splits = cpu_paged.choose_splits(t * hkv, slots.shape[1])
    widest = max(h, hq * d, inter)
    floats = {
        "h": t * h,
        "qkv": t * (hq + 2 * hkv) * d,
        "q": t * hq * d,
        "attn": t * hq * d,
        "lse": t * hq,
        "part": t * hkv * splits * (hq // hkv) * (d + 2),
        "o": t * h,
        "gate_up": t * 2 * inter,
        "act": t * inter,
        "xs": t * -(-widest // int4_gemm.GROUP),
        "xsum": t * -(-widest // int4_gemm.GROUP),
    }
    scratch = torch.empty(sum(floats.values()), dtype=torch.float32)
    # quantized activations: int8 for grouped weights, int16 for int8 channels
    a = torch.empty(t * -(-widest // int4_gemm.GROUP) * int4_gemm.GROUP, dtype=torch.int16)
    at, pointers = scratch.data_ptr(), {}
    for name, n in floats.items():
        pointers[name] = at
        at += 4 * n
    step = Step(
        t,
        h,
        hq,
        hkv,
        d,
        inter,
        slots.shape[1],
        splits,
        shape.eps,
        d**-0.5,
        cos.data_ptr(),
        sin.data_ptr(),
        out_slots.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        **pointers,
        a=a.data_ptr(),
    )
    native.built(_library(isa)).decode_layers(
        layers, len(layers), ctypes.byref(step), x.data_ptr(), residual.data_ptr()
    )
