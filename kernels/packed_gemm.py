"""Weight-only matrix multiply on the GPU (Triton): `x @ dequant(w).T + bias` over the packed
weights the CPU kernels read, as they are stored: `int4_gemm.PackedGroups` (4- or 8-bit groups
of 32 inputs, `w = d q + m`, or 6-bit ones with a d for each half: `--quantization int4`,
GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and K-quant blocks, GPTQ, AWQ and
compressed-tensors groups) and `int8_gemm.PackedInt8` (int8, one scale per output channel:
`--quantization int8`, compressed-tensors W8A8 and FP8). One layout for both devices: the
packed tensors move to the GPU as they are, and no float copy of a weight is ever kept.

Each program computes a BLOCK_M x BLOCK_N tile of outputs, one group of 32 inputs at a time:
it loads the activations' group and the weights' integers as 32-bit words of the CPU layout (a
panel's group, 8 rows x 32 inputs, is one contiguous run of 128 or 256 bytes: `int4_gemm`'s
docstring), multiplies them with `tl.dot` in x's dtype (the integers, |q| <= 128, are exact in
float16 and bfloat16), and adds the group's float32 sums to the accumulator as `d * (x . q) +
m * sum(x)`: the numerics of `PackedGroups.dequantize` (`w = d q + m`), with the scales applied
in float32 rather than rounded into x's dtype with each weight. Per-channel int8 scales each
output once, at the end. The bias is added in float32; the output is x's dtype. Activations
stay float (the CPU kernels quantize them to int8 or int16): the result is x @
w.dequantize().T to float32 rounding in float32, and to x's dtype's rounding of the result in
half precision. A decode batch (few rows, so few tiles) also cuts its inputs into parts, one
program each, whose float32 sums are added after in a fixed order (`launch_config`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .extend_attention import dot_precision
from .int4_gemm import GROUP, IMPLIED_OFFSET, PANEL, Bits, PackedGroups
from .int8_gemm import ROWS, PackedInt8
from .jit import jit

# the word arithmetic of `_codes` is written for these
assert GROUP == 32 and PANEL == 8 and ROWS == 4
SMALL_M = 16  # rows up to which a tile is 16 x 32 (decode), else 64 x 64 (prefill)
MAX_SPLITS, SPLIT_GROUPS = 8, 16  # decode: parts the inputs are cut into, least groups a part


class Format(enum.IntEnum):
    """How a packed weight's words hold its values (the kernel's FORMAT)."""

    GROUPS4 = 0  # PackedGroups, 4 bits: a word is 4 bytes of a row's block (8 nibbles)
    GROUPS8 = 1  # PackedGroups, 8 bits: a word is 4 signed bytes of a row's block
    CHANNEL8 = 2  # PackedInt8: a word is 4 signed bytes of a tile's row
    GROUPS5 = 3  # PackedGroups, 5 bits: GROUPS4's words, then a word of a row's high bits
    GROUPS6 = 4  # PackedGroups, 6 bits: GROUPS4's words, then two of top bits (`six_high`)
    GROUPS_IQ4 = 5  # PackedGroups, IQ4_NL: GROUPS4's words, each nibble a level's index


_GROUPS4 = tl.constexpr(Format.GROUPS4.value)  # the kernels' names for them
_GROUPS5 = tl.constexpr(Format.GROUPS5.value)
_GROUPS6 = tl.constexpr(Format.GROUPS6.value)
_GROUPS_IQ4 = tl.constexpr(Format.GROUPS_IQ4.value)
_CHANNEL8 = tl.constexpr(Format.CHANNEL8.value)
# the symmetric forms' implied offset, in steps d (`int4_gemm.IMPLIED_OFFSET`)
_OFFSET4, _OFFSET5 = (
    tl.constexpr(IMPLIED_OFFSET[Bits.INT4]),
    tl.constexpr(IMPLIED_OFFSET[Bits.INT5]),
)


@jit
def _signed_byte(words: tl.tensor, shift: tl.tensor) -> tl.tensor:
    """The byte at bit `shift` of int32 `words`, as a signed value."""
    byte = (words >> shift) & 0xFF
    return tl.where(byte > 127, byte - 256, byte)


@jit
def _iq4_level(nibble: tl.tensor) -> tl.tensor:
    """IQ4_NL's level (`int4_gemm.IQ4_LEVELS`) of each index 0..15."""
    level = tl.where(nibble == 0, -127, 0)
    level = tl.where(nibble == 1, -104, level)
    level = tl.where(nibble == 2, -83, level)
    level = tl.where(nibble == 3, -65, level)
    level = tl.where(nibble == 4, -49, level)
    level = tl.where(nibble == 5, -35, level)
    level = tl.where(nibble == 6, -22, level)
    level = tl.where(nibble == 7, -10, level)
    level = tl.where(nibble == 8, 1, level)
    level = tl.where(nibble == 9, 13, level)
    level = tl.where(nibble == 10, 25, level)
    level = tl.where(nibble == 11, 38, level)
    level = tl.where(nibble == 12, 53, level)
    level = tl.where(nibble == 13, 69, level)
    level = tl.where(nibble == 14, 89, level)
    return tl.where(nibble == 15, 113, level)


@jit
def _codes(
    W: tl.tensor,
    g: tl.tensor,
    ks: tl.tensor,
    ns: tl.tensor,
    G: tl.tensor,
    keep: tl.tensor,
    FORMAT: tl.constexpr,
) -> tl.tensor:
    """The integers [GROUP, BLOCK_N] of group `g`'s inputs `ks` [GROUP, 1] and outputs `ns`
    [1, BLOCK_N] (zero where not `keep`), from W, the packed tiles as int32 words."""
    if FORMAT == _CHANNEL8:
        # PackedInt8: tiles [N/4, G, 4, 32] int8; input k of row n at ((n/4 G + g) 4 + n%4) 32
        row = (ns // 4 * G + g) * 4 + ns % 4
        return _signed_byte(tl.load(W + row * 8 + ks // 4, mask=keep, other=0), 8 * (ks % 4))
    # PackedGroups: a panel's group is its 8 rows' blocks interleaved by word (word s of row j
    # at s * 8 + j); 4 bits: byte b of a block holds input b (low nibble) and b + 16 (high);
    # 5 bits: those 4 words, then a word whose bit k is input k's high bit (worth 16)
    block = g + ns // 8 * G
    if FORMAT == _GROUPS4 or FORMAT == _GROUPS_IQ4:
        b = ks % 16
        words = tl.load(W + block * 32 + (b // 4) * 8 + ns % 8, mask=keep, other=0)
        nibble = (words >> (8 * (b % 4) + 4 * (ks // 16))) & 0xF
        if FORMAT == _GROUPS4:
            return nibble
        return _iq4_level(nibble)
    if FORMAT == _GROUPS5:
        b = ks % 16
        words = tl.load(W + block * 40 + (b // 4) * 8 + ns % 8, mask=keep, other=0)
        high = tl.load(W + block * 40 + 32 + ns % 8, mask=keep, other=0)
        return ((words >> (8 * (b % 4) + 4 * (ks // 16))) & 0xF) | (((high >> ks) & 1) << 4)
    if FORMAT == _GROUPS6:  # signed, q - 32; the top 2 bits of input 4q + b of a half at byte
        b = ks % 16  # b of its half's word, bits 2q (`int4_gemm.six_high`)
        words = tl.load(W + block * 48 + (b // 4) * 8 + ns % 8, mask=keep, other=0)
        top = tl.load(W + block * 48 + 32 + (ks // 16) * 8 + ns % 8, mask=keep, other=0)
        low = (words >> (8 * (b % 4) + 4 * (ks // 16))) & 0xF
        high = (top >> (8 * (b % 4) + 2 * (b // 4))) & 3
        return tl.where(keep, (low | (high << 4)) - 32, 0)
    words = tl.load(W + block * 64 + (ks // 4) * 8 + ns % 8, mask=keep, other=0)
    return _signed_byte(words, 8 * (ks % 4))


@jit
def _packed_linear_kernel(
    X: tl.tensor,
    W: tl.tensor,
    S: tl.tensor,
    B: tl.tensor,
    Y: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    G: tl.tensor,
    per_split: tl.tensor,
    stride_x: tl.tensor,
    stride_y: tl.tensor,
    stride_split: tl.tensor,
    FORMAT: tl.constexpr,
    OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    """Y[split][rows, cols] = X[rows, inputs] @ dequant(W)[cols, inputs].T (+ B[cols]) for
    program (row block, column block, split): the split's `per_split` groups of inputs (all of
    them where there is one split). X's inputs contiguous. S: the float16 scales of
    PackedGroups (each panel's group: 8 rows' d, then, with OFFSETS, their m; without, the
    symmetric forms' implied -8 d for 4 bits, -16 d for 5 and 0 for 8 and IQ4; 6 bits: the 8
    rows' d of the first half, then of the second), or PackedInt8's float32 scale of each
    output."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(2) * per_split
    ks = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, tl.minimum(first + per_split, G)):
        k = g * 32 + ks
        x = tl.load(
            X + rows[:, None] * stride_x + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        keep = (k[:, None] < K) & (ns[None, :] < N)
        q = _codes(W, g, ks[:, None], ns[None, :], G, keep, FORMAT)
        if FORMAT == _GROUPS6:  # a d for each half of the group: the halves' dots apart
            first_half = ks[:, None] < 16
            low = tl.dot(x, tl.where(first_half, q, 0).to(x.dtype), input_precision=DOT_PRECISION)
            high = tl.dot(x, tl.where(first_half, 0, q).to(x.dtype), input_precision=DOT_PRECISION)
            scale = S + (g + ns // 8 * G) * 16 + ns % 8
            d = tl.load(scale, mask=ns < N, other=0.0).to(tl.float32)
            d2 = tl.load(scale + 8, mask=ns < N, other=0.0).to(tl.float32)
            acc += low * d[None, :] + high * d2[None, :]
        else:
            part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
            if FORMAT == _CHANNEL8:
                acc += part
            else:
                width = 16 if OFFSETS else 8
                scale = S + (g + ns // 8 * G) * width + ns % 8
                d = tl.load(scale, mask=ns < N, other=0.0).to(tl.float32)
                if OFFSETS:
                    m = tl.load(scale + 8, mask=ns < N, other=0.0).to(tl.float32)
                elif FORMAT == _GROUPS4:
                    m = d * _OFFSET4
                elif FORMAT == _GROUPS5:
                    m = d * _OFFSET5
                else:
                    m = d * 0.0
                xsum = tl.sum(x.to(tl.float32), axis=1)
                acc += part * d[None, :] + xsum[:, None] * m[None, :]
    if FORMAT == _CHANNEL8:
        acc *= tl.load(S + ns, mask=ns < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    out = Y + tl.program_id(2) * stride_split + rows[:, None] * stride_y + ns[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (ns[None, :] < N))


@dataclass(frozen=True)
class Launch:
    """A call's tile (`block_m` rows x `block_n` outputs) and the parts its inputs are cut
    into (`splits`: each part's sums go to a float32 buffer, added after in torch, in order)."""

    block_m: int
    block_n: int
    splits: int


def launch_config(m: int, groups: int) -> Launch:
    """The launch for `m` rows over `groups` groups of inputs. Decode batches: few tiles of
    rows, so narrow tiles of outputs and the inputs cut in up to `MAX_SPLITS` parts of at
    least `SPLIT_GROUPS` groups, to give the GPU's multiprocessors enough programs; prefill:
    64 x 64, one part. Untuned guesses until `radixrt bench --workload gpu-check` times them on
    a device."""
    if m <= SMALL_M:
        return Launch(SMALL_M, 32, max(1, min(MAX_SPLITS, groups // SPLIT_GROUPS)))
    return Launch(64, 64, 1)


def _format(w: PackedGroups | PackedInt8) -> tuple[Format, int]:
    """How `w`'s words hold its values, and its groups of 32 inputs."""
    if isinstance(w, PackedInt8):
        return Format.CHANNEL8, w.padded_in_features // GROUP
    formats = {
        Bits.INT4: Format.GROUPS4,
        Bits.INT5: Format.GROUPS5,
        Bits.INT6: Format.GROUPS6,
        Bits.IQ4: Format.GROUPS_IQ4,
        Bits.INT8: Format.GROUPS8,
    }
    return formats[w.bits], w.groups


def packed_linear_fwd(
    x: torch.Tensor, w: PackedGroups | PackedInt8, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) -> [M, N] in x's dtype: x @ w.dequantize().T +
    bias, summed in float32. `w`'s tensors and `bias` (float32) on x's device. One launch, or
    for inputs cut in parts (decode: `launch_config`) one launch into float32 parts, their sum
    (in split order: the same bits every call) and the bias."""
    x = x.contiguous()
    fmt, groups = _format(w)
    m, n = x.shape[0], w.out_features
    launch = launch_config(m, groups)
    per_split = triton.cdiv(groups, launch.splits)
    splits = triton.cdiv(groups, per_split)
    if splits == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), splits)
    _packed_linear_kernel[grid](
        x,
        w.tiles.view(torch.int32),
        w.scales,
        bias if splits == 1 else None,
        out,
        m,
        n,
        w.in_features,
        groups,
        per_split,
        x.stride(0),
        out.stride(-2),
        out.stride(0) if splits > 1 else 0,
        FORMAT=fmt.value,
        OFFSETS=isinstance(w, PackedGroups) and w.offsets,
        HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    if splits == 1:
        return out
    total = out.sum(0)
    if bias is not None:
        total += bias
    return total.to(x.dtype)
