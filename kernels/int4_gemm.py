"""Weight-only grouped matrix multiply for the CPU (AVX2; AVX-512 VNNI): `x @ dequant(w).T + bias`, with 4-bit
weights (`--quantization int4`, GGUF Q4_0/Q4_1/Q4_K), 4-bit indices of IQ4_NL's 16 levels (GGUF
IQ4_NL/IQ4_XS), 5-bit ones (GGUF Q5_0/Q5_1/Q5_K), 6-bit ones (GGUF Q6_K) or 8-bit ones (GGUF Q8_0)
in groups of 32 inputs; 3-bit and 2-bit ones with an integer scale for each half (GGUF
Q3_K/Q2_K, `SUB_SCALED`; the paragraph before the last); and 16-bit weights, float16 or
bfloat16 (GGUF F16/BF16), at their own size (`HALF_DTYPES`; the last paragraph).

A group of 32 weights of one output row is `w = d * q + m`: q unsigned 4-bit (0..15) with a
scale d and an offset m (asymmetric; symmetric is m = -8 d, which is how GGUF's Q4_0 reads), or
q signed 8-bit with m = 0 (Q8_0). d and m are float16, so a 4-bit weight costs 0.625 bytes, near
llama.cpp's Q4_0 (0.5625) and Q4_1 (0.625). GGUF's blocks are moved, never re-rounded: a block's
nibbles keep GGUF's pairing (byte b holds input b in its low half, input b + 16 in its high half).
A 5-bit group is a 4-bit one and 4 bytes of high bits, GGUF's Q5_0 `qh` (bit k: input k's, worth
16): q 0..31, its symmetric form m = -16 d (Q5_0's); 0.75 bytes a weight with d (Q5_0: 0.6875).

The layout: panels of 8 output rows interleaved, one output row per 32-bit lane of an AVX2
vector (llama.cpp's repacked Q4_0 is the model). A panel's group is 4 vectors of 32 bytes for
4-bit weights: vector s holds, in lane j, bytes 4s..4s+3 of row j's block, so its low nibbles
are inputs 4s..4s+3 and its high nibbles inputs 16+4s..16+4s+3; 8-bit groups are 8 vectors, vector t
holding inputs 4t..4t+3 of each row (t < 4) or 16+4(t-4).. (t >= 4), the order the nibbles
unpack in; 5-bit groups are the 4-bit vectors and a fifth whose lane j is row j's high bits;
6-bit groups the 4-bit vectors and two of top bits (a half's each); IQ4 groups the 4-bit
vectors, each nibble looked up (`vpshufb`) in the levels as a signed byte.
Beside them, each panel's group has its 8 scales d, then its 8 offsets m.

The multiply: activations are quantized per group of 32 to int8 once per call (llama.cpp's Q8
activations; relative error about 1/254 of each group's largest value). Four consecutive
activations of one row, broadcast to every lane, meet four weights of each of the 8 rows in one
`vpmaddubsw`, so a lane accumulates one output and no horizontal add is ever needed. Int16 sums
cannot overflow within a group: a pair is at most 2 * 15 * 127 = 3,810, and a lane sums 8 pairs
(30,480); 5-bit ones (a pair up to 7,874) go to int32 at each step, and 8-bit weights move
their sign onto the activation (`vpsignb`, |q| <= 128) and go to int32 at each step. A group's integer sum meets its float scales once; the offset's share of a
group is m times the quantized activations' sum (s times their integer sum: the offset and the
integer part see the same activations, so their rounding errors cancel as in (d q + m) . a s, the
error of w itself; with the exact sum it would be the error of d q alone, about twice w's for
Q4_0's -8 d; llama.cpp's Q8_1 activations keep that sum for the same reason).

Many rows (prefill, M >= 4): a register tile of 4 rows x one panel; the activation rows are
taken in blocks of at most 256 KiB (they stay in L2 while every panel passes over them), and
each tile unpacks the panel's nibbles in registers (a panel of a 5,632-wide row is 22 KiB: it
stays in L1 for the next tile). Few rows (decode, M <= 3): one tile, each panel read once, as
a stream. On AVX-512 VNNI hosts (`--cpu-isa avx512-vnni`) the same code sums a group's products
with `vpdpbusd` in two int32 chains (the instruction's latency sits in its chain). On AMX hosts
(`--cpu-isa amx`) 16 rows and more go to the tile unit (`amx_body`): each group's products of 16
weight rows by 16 activation rows in one `tdpbusd`, then the same float steps; fewer rows take
the VNNI code.

Sub-scaled widths (`Bits.INT3`, `Bits.INT2`: GGUF's Q3_K and Q2_K, whose sub-blocks of 16 each
scale the super-block's d by a small integer): a panel's group is 2 vectors of 2-bit fields
(vector h's lane j: row j's half h, byte b holding inputs b, 4 + b, 8 + b, 12 + b of the half at
bits 0-1, 2-3, 4-5, 6-7, as `six_high`), and for INT3 a vector of high bits (`three_high`);
beside the panel's d (and INT2's dmin), each row's two scale bytes as stored: 4 bits a weight
for INT3 (Q3_K: 3.44), 3.5 for INT2 (Q2_K: 2.625). One shift and mask unpacks vector q; INT3's
values are signed (q - 4) and take the sign path. Each half's integer sum (at most 16 * 4 * 127:
int16) meets its row's integer scale in one `vpmaddwd`, exact, and the group's float scales
apply once: (sc0 s0 + sc1 s1) d xs, less INT2's (mn0 a0 + mn1 a1) dmin xs, a0 and a1 the
quantized activations' integer sums over the halves (`vpsadbw`). Every path sums the same
integers, so avx2 and AVX-512 give the same bits, each row alone; the AMX path takes their
VNNI code. The values are gguf's dequantization bit for bit (d (sc q) is d sc q exactly).

16-bit widths (`Bits.F16`, `Bits.BF16`): a panel's group holds its 32 inputs in 16 pairs, a
pair its 8 rows' two weights each (32 bytes), the values as stored, and no scales: 2 bytes a
weight, half of float32's. The kernel (`half_body`) converts them to float32 as it reads them
(exact: `vcvtph2ps` for F16, a 16-bit shift for BF16) and multiplies the float activations, not
quantized, in fused multiply-adds, a pair's two activations broadcast as one 64-bit word: each
output sums its even inputs and its odd ones in two chains, in order, then adds the two and the
bias. So a row's result does not depend on the rows computed beside it, avx2 and AVX-512 (a
panel's pair in one 512-bit vector) give the same bits, and neither shuffles; K is any (an odd
K's last input pairs with a zero). A decode row takes 4 panels at a time, each read once;
prefill takes tiles of up to 6 rows.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field, replace

import torch

from . import cpu_isa, native

PANEL, GROUP = 8, 32  # a panel's output rows; inputs per group
QUANTIZE_BYTES = 4 << 20  # float weights `PackedGroups.quantize` rounds at a time

SOURCE = native.CSRC / "int4_gemm.c"
P, I = native.POINTER, native.INT64
SIGNATURES = (
    ("int4_linear", (P,) * 8 + (I,) * 5),
    ("int5_linear", (P,) * 8 + (I,) * 5),
    ("int6_linear", (P,) * 8 + (I,) * 5),
    ("int3_linear", (P,) * 8 + (I,) * 5),
    ("int2_linear", (P,) * 8 + (I,) * 5),
    ("iq4_linear", (P,) * 8 + (I,) * 5),
    ("q8_linear", (P,) * 8 + (I,) * 5),
    ("quantize_row", (P,) * 4 + (I,) * 2),
    ("half_linear", (P,) * 4 + (I,) * 5),
)
AMX_SIGNATURES = (
    ("int4_linear_amx", (P,) * 8 + (I,) * 5),
    ("int5_linear_amx", (P,) * 8 + (I,) * 5),
    ("iq4_linear_amx", (P,) * 8 + (I,) * 5),
    ("q8_linear_amx", (P,) * 8 + (I,) * 5),
)
AMX_MIN_ROWS = 16  # fewer rows take the VNNI code: a tile of 16 activation rows would be padded


def _library(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2) -> ctypes.CDLL | None:
    """The kernels of `isa`, built on first use. Building and loading them needs no more than a
    compiler (every path builds on any host); running the AMX ones needs the tile state, which
    `cpu_isa.host_paths` asks of Linux before it offers the path."""
    amx = isa is cpu_isa.Isa.AMX
    signatures = SIGNATURES + (AMX_SIGNATURES if amx else ())
    return native.load(f"int4_gemm-{isa.value}", SOURCE, signatures, isa.cflags)


def available(isa: cpu_isa.Isa = cpu_isa.Isa.AVX2) -> bool:
    """Whether this CPU runs the kernel on `isa` (the CPU has it, a compiler builds it);
    builds it on first use."""
    return isa in cpu_isa.host_paths() and _library(isa) is not None


class Bits(enum.IntEnum):
    """How a group's weights are stored: 16 bytes of nibbles; those and 4 bytes of high bits
    (bit k: input k's, GGUF's Q5_0 `qh`), values 0 to 31; those and 8 bytes of 2 high bits
    (`six_high`), values q - 32 in [-32, 31] with a d for each half of the group (Q6_K's
    sub-blocks of 16) and no offset; or 32 signed bytes; or (IQ4, the kernel's kind 9) 16
    bytes of nibbles that index `IQ4_LEVELS`, IQ4_NL's, with no offset; or (F16 and BF16, the
    kernel's kinds 16 and 17) the 32 weights themselves, 2 bytes each, no scale; or the
    `SUB_SCALED` widths (GGUF's Q3_K and Q2_K: sub-blocks of 16 with integer scales of a
    float16 d), whose halves each carry a small integer scale: INT3, 8 bytes of 2-bit fields
    (`six_high`'s order) and 4 of high bits (`three_high`), values q - 4 in [-4, 3], w = d sc q
    with sc an int8 (Q3_K's 6-bit scale - 32); INT2, the 2-bit fields alone, values 0..3, w = d
    sc q - dmin mn with sc and mn the 4-bit halves of Q2_K's scale byte (m holds dmin)."""

    INT2 = 2
    INT3 = 3
    INT4 = 4
    INT5 = 5
    INT6 = 6
    INT8 = 8
    IQ4 = 9
    F16 = 16
    BF16 = 17

    @property
    def tile_bytes(self) -> int:
        """Bytes a group's values take in the panels."""
        stored = 4 if self == Bits.IQ4 else 16 if self in HALF_DTYPES else int(self)
        return GROUP * stored // 8

    @property
    def group_bytes(self) -> int:
        """Bytes of a group in `PackedGroups.from_blocks`' q: its values, then (`SUB_SCALED`)
        its halves' two scale bytes, which the panels keep beside the float16 scales."""
        return self.tile_bytes + (2 if self in SUB_SCALED else 0)


# the 16-bit widths: their weights' own dtypes
HALF_DTYPES = {Bits.F16: torch.float16, Bits.BF16: torch.bfloat16}
# the widths whose halves (sub-blocks of 16) scale their values by an integer of their own
SUB_SCALED = (Bits.INT3, Bits.INT2)
# the widths the AMX path takes (the others' halves need K = 16 tiles: their VNNI code runs)
AMX_WIDTHS = (Bits.INT4, Bits.INT5, Bits.IQ4, Bits.INT8)


# llama.cpp's kvalues_iq4nl: the 16 int8 levels an IQ4_NL or IQ4_XS nibble stands for
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_TABLE = torch.tensor(IQ4_LEVELS, dtype=torch.int8)  # rows() looks tokens up through it


def _round(
    weight: torch.Tensor, bits: Bits, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of float weights as `PackedGroups.from_blocks` takes them: q [N, G, group bytes],
    d and m float16 [N, G] (m None for the symmetric forms: 8-bit groups, 4-bit symmetric),
    rounded by `PackedGroups.quantize`'s rules."""
    n, k = weight.shape
    groups = -(-k // GROUP)
    w = torch.zeros(n, groups * GROUP)
    w[:, :k] = weight.detach()
    w = w.view(n, groups, GROUP)
    if bits == Bits.INT8:
        return *int8_groups(w), None
    if symmetric:
        top = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)
        d = (top / -8).half()
        m = (-8 * d.float()).half()
    else:
        low, high = w.amin(dim=2), w.amax(dim=2)
        d, m = ((high - low) / 15).half(), low.half()
    inv = torch.where(d == 0, 0.0, 1 / d.float())
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4), d, None if symmetric else m


# the symmetric forms' offset, in steps d: Q4_0's -8, Q5_0's -16, Q8_0's 0; 6-bit groups are
# signed as unpacked (q - 32), with no offset
IMPLIED_OFFSET = {Bits.IQ4: 0, Bits.INT4: -8, Bits.INT5: -16, Bits.INT6: 0, Bits.INT8: 0}


def implied_offsets(d: torch.Tensor, bits: Bits) -> torch.Tensor:
    """The offsets m of groups stored without them (the symmetric forms), float16 like d:
    `IMPLIED_OFFSET` steps (exact: power-of-two multiples)."""
    return (IMPLIED_OFFSET[bits] * d.float()).half()


@dataclass
class PackedGroups:
    """A weight [N, K] as panels of 8 rows interleaved by lane (the module's docstring), with
    each panel's float16 scales and, for asymmetric groups (`offsets`), offsets; the symmetric
    forms (8-bit groups, Q4_0's 4-bit ones) imply theirs (`implied_offsets`) and read 2 bytes a
    group less; the 16-bit widths have none. The kernel's arguments that never change are read
    once here rather than on every call. Built by `quantize` (from float weights),
    `from_blocks` (GGUF's blocks, as stored) or `from_halves` (16-bit weights, as stored)."""

    tiles: torch.Tensor  # uint8 [ceil(N/8), G, 8 * tile bytes], G = ceil(K/32)
    # float16 [ceil(N/8), G, 16]: the 8 rows' d, then their m (or 8: d; 0: a 16-bit width);
    # `SUB_SCALED` widths add 8 slots of the rows' two scale bytes (int8 for INT3, Q2_K's
    # scale and min nibbles for INT2), stored in float16's place as they are
    scales: torch.Tensor
    out_features: int
    in_features: int
    bits: Bits
    groups: int = field(init=False)
    offsets: bool = field(init=False)
    tiles_ptr: int = field(init=False)
    scales_ptr: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.tiles.is_contiguous() and self.scales.is_contiguous()
        assert self.scales.shape[2] in ((0,) if self.half else (PANEL, 2 * PANEL, 3 * PANEL))
        self.groups = self.tiles.shape[1]
        # 6-bit groups' second 8 scales are their second halves' d, not offsets
        floats = self.scales.shape[2] // PANEL - (self.bits in SUB_SCALED)
        self.offsets = floats == 2 and self.bits != Bits.INT6
        self.tiles_ptr, self.scales_ptr = self.tiles.data_ptr(), self.scales.data_ptr()

    @property
    def half(self) -> bool:
        """Whether the weights are 16-bit (`HALF_DTYPES`), not groups of integers."""
        return self.bits in HALF_DTYPES

    @property
    def nbytes(self) -> int:
        """Bytes a multiply reads: the packed weights, scales and offsets."""
        return self.tiles.nbytes + self.scales.nbytes

    def to(self, device: torch.device) -> PackedGroups:
        """The same packing on `device` (a GPU's Triton kernel reads it as stored), but the
        `SUB_SCALED` widths, which that kernel does not read: on a GPU they become 8-bit groups
        by Q8_0's rule (`quantize`; within half an 8-bit step of each group's largest
        magnitude), as GGUF's Q2_K was before they existed, and Q3_K in 8 bits, not 6."""
        if device.type != "cpu" and self.bits in SUB_SCALED:
            return PackedGroups.quantize(self.dequantize(), Bits.INT8).to(device)
        return replace(self, tiles=self.tiles.to(device), scales=self.scales.to(device))

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bits: Bits = Bits.INT4, symmetric: bool = False
    ) -> PackedGroups:
        """Groups of 32 by round-to-nearest. 4-bit asymmetric spans each group's [min, max]
        with 16 levels; 4-bit symmetric is GGUF's Q4_0 rule (the largest magnitude maps to -8,
        so q - 8 covers [-8, 7] d); 8-bit is Q8_0's (symmetric, q in [-127, 127]). Rows are
        rounded and packed `QUANTIZE_BYTES` of float at a time, straight into the result: the
        temporaries stay that small whatever the weight (rows round independently, so the
        result is the same as in one pass). On the CPU, wherever `weight` lies."""
        if bits in (Bits.IQ4, Bits.INT5, Bits.INT6, *SUB_SCALED):
            raise ValueError(f"{int(bits)}-bit groups come from GGUF's blocks (from_blocks)")
        if bits in HALF_DTYPES:
            raise ValueError(f"{bits.name} weights are packed as stored (from_halves)")
        n, k = weight.shape
        groups = -(-k // GROUP)
        width = 2 * PANEL if bits == Bits.INT4 and not symmetric else PANEL
        tiles = torch.empty(-(-n // PANEL), groups, PANEL * bits.group_bytes, dtype=torch.uint8)
        scales = torch.empty(-(-n // PANEL), groups, width, dtype=torch.float16)
        step = max(1, QUANTIZE_BYTES // (groups * GROUP * 4 * PANEL)) * PANEL
        for start in range(0, n, step):
            part = cls.from_blocks(*_round(weight[start : start + step], bits, symmetric), k, bits)
            at = start // PANEL
            tiles[at : at + part.tiles.shape[0]] = part.tiles
            scales[at : at + part.scales.shape[0]] = part.scales
        return cls(tiles, scales, n, k, bits)

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, in_features: int, bits: Bits
    ) -> PackedGroups:
        """Rows of blocks as GGUF stores them: q [N, G, group bytes] (nibbles in GGUF's order,
        or int8 values viewed as uint8; `SUB_SCALED` widths: the values, then the halves' two
        scale bytes), d and m float16 [N, G] (m None: the symmetric form's, `implied_offsets`,
        and none stored; 6-bit groups: d [N, G, 2], each half's, m None; INT2: m is dmin).
        The values are moved into panels (a transpose of 4-byte words), the scale bytes beside
        d, never converted."""
        n, groups = d.shape[:2]
        np_, tb = -(-n // PANEL) * PANEL, bits.tile_bytes
        padded = torch.zeros(np_, groups, tb, dtype=torch.uint8)
        padded[:n] = q.view(torch.uint8)[..., :tb]
        words = padded.view(np_ // PANEL, PANEL, groups, tb // 4, 4)
        tiles = words.permute(0, 2, 3, 1, 4).reshape(np_ // PANEL, groups, -1).contiguous()
        del padded, words
        # d, d and m, or both halves' d; then the scale bytes
        kinds = (1 if m is None and bits != Bits.INT6 else 2) + (bits in SUB_SCALED)
        scales = torch.zeros(np_, groups, kinds, dtype=torch.float16)
        if bits == Bits.INT6:
            scales[:n] = d
        else:
            scales[:n, :, 0] = d
        if m is not None:
            scales[:n, :, 1] = m
        if bits in SUB_SCALED:
            scales[:n, :, -1] = (
                q.view(torch.uint8)[..., tb:].contiguous().view(torch.float16)[..., 0]
            )
        scales = scales.view(np_ // PANEL, PANEL, groups, kinds).permute(0, 2, 3, 1)
        return cls(
            tiles,
            scales.reshape(np_ // PANEL, groups, kinds * PANEL).contiguous(),
            n,
            in_features,
            bits,
        )

    @classmethod
    def from_halves(cls, weight: torch.Tensor) -> PackedGroups:
        """A float16 or bfloat16 weight [N, K] (F16 or BF16 by its dtype) in panels of pairs of
        inputs (the module's docstring), its values moved, never converted; zeros past N and K.
        Rows are laid out `QUANTIZE_BYTES` at a time, straight into the result: a load holds the
        weight, its panels and no more than that of temporaries."""
        bits = {dtype: bits for bits, dtype in HALF_DTYPES.items()}[weight.dtype]
        n, k = weight.shape
        groups = -(-k // GROUP)
        kp = groups * GROUP
        panels = torch.empty(-(-n // PANEL), kp // 2, PANEL, 2, dtype=weight.dtype)
        step = max(1, QUANTIZE_BYTES // (kp * 2 * PANEL)) * PANEL
        for start in range(0, n, step):
            part = weight[start : start + step]
            rows = torch.zeros(-(-len(part) // PANEL) * PANEL, kp, dtype=weight.dtype)
            rows[: len(part), :k] = part
            at = start // PANEL
            panels[at : at + len(rows) // PANEL] = rows.view(-1, PANEL, kp // 2, 2).transpose(1, 2)
        tiles = panels.view(torch.uint8).view(len(panels), groups, -1)
        return cls(tiles, torch.empty(len(panels), groups, 0, dtype=torch.float16), n, k, bits)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`from_blocks`' inverse: q uint8 [N, G, group bytes] (GGUF's order), d and m float16
        [N, G] (m implied where not stored: `implied_offsets`; 6-bit groups: d [N, G, 2];
        INT3: m zeros)."""
        panels, groups = self.tiles.shape[:2]
        words = self.tiles.view(panels, groups, -1, PANEL, 4).permute(0, 3, 1, 2, 4)
        q = words.reshape(panels * PANEL, groups, -1)[: self.out_features]
        kinds = self.scales.shape[2] // PANEL
        sc = self.scales.view(panels, groups, kinds, PANEL).permute(0, 3, 1, 2)
        sc = sc.reshape(panels * PANEL, groups, kinds)[: self.out_features]
        return self._groups(q, sc)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        if self.half:
            panels = self._halves()
            whole = panels.transpose(1, 2).reshape(len(panels) * PANEL, -1)
            return whole[: self.out_features, : self.in_features].float()
        return self._floats(*self.blocks())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [M], each in [0, N)) of the float32 weight, [M, K]: the same values
        as `dequantize()[ids]`, from those rows' blocks alone (an embedding table kept packed)."""
        if self.half:
            pairs = self._halves()[ids // PANEL, :, ids % PANEL]  # [M, Kp / 2, 2]
            return pairs.reshape(len(ids), -1)[:, : self.in_features].float()
        panels, groups = self.tiles.shape[:2]
        panel, lane = ids // PANEL, ids % PANEL
        q = self.tiles.view(panels, groups, -1, PANEL, 4)[panel, :, :, lane]
        kinds = self.scales.shape[2] // PANEL
        sc = self.scales.view(panels, groups, kinds, PANEL)[panel, :, :, lane]
        q = q.reshape(len(ids), groups, self.bits.tile_bytes)
        return self._floats(*self._groups(q, sc))

    def _halves(self) -> torch.Tensor:
        """A 16-bit width's panels [ceil(N/8), G * 16, 8, 2] (pairs of inputs by rows) in its
        dtype: a view of `tiles`."""
        return self.tiles.view(HALF_DTYPES[self.bits]).view(len(self.tiles), -1, PANEL, 2)

    def _groups(
        self, q: torch.Tensor, sc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Groups' values q [..., tile bytes] and scale slots sc [..., slots] (the panels'
        order undone) as `blocks`' q, d and m: d, then m where stored, implied where not;
        6-bit groups: both halves' d, [..., 2], and no offset (zeros, as INT3's); the
        `SUB_SCALED` widths' scale bytes (the last slot) back after their values."""
        if self.bits in SUB_SCALED:
            pair = sc[..., -1:].view(torch.int16)  # the two bytes, little-endian
            scale_bytes = torch.cat([pair & 0xFF, (pair >> 8) & 0xFF], dim=-1).to(torch.uint8)
            q = torch.cat([q, scale_bytes], dim=-1)
            sc = sc[..., :-1]
        if self.bits in (Bits.INT6, Bits.INT3):
            return q, sc if self.bits == Bits.INT6 else sc[..., 0], torch.zeros_like(sc[..., 0])
        m = sc[..., 1] if self.offsets else implied_offsets(sc[..., 0], self.bits)
        return q, sc[..., 0], m

    def _floats(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Blocks q [R, G, group bytes], d and m [R, G] (`blocks`' form) as float32 [R, K]."""
        groups = q.shape[1]
        if self.bits in SUB_SCALED:
            return self._sub_scaled(q, d, m).reshape(len(q), -1)[:, : self.in_features]
        if self.bits == Bits.INT8:
            q = q.view(torch.int8)
        else:
            values = torch.cat([q[..., :16] & 0x0F, q[..., :16] >> 4], dim=2)
            if self.bits == Bits.INT5:
                values = values | high_bits(q[..., 16:])
            elif self.bits == Bits.INT6:
                values = values | (six_high(q[..., 16:]) << 4)
            elif self.bits == Bits.IQ4:
                values = _IQ4_TABLE[values.long()]
            q = values
        if self.bits == Bits.INT6:  # each half's d, no offset
            w = (q.float() - 32) * d.float().repeat_interleave(16, dim=-1)
        else:
            w = q.float() * d.float()[..., None] + m.float()[..., None]
        return w.reshape(len(q), groups * GROUP)[:, : self.in_features]

    def _sub_scaled(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """`SUB_SCALED` groups q [R, G, group bytes], d and m [R, G] as float32 [R, G, 32]: d
        times each half's integer scale times its values (an integer: exact), less INT2's
        dmin times each half's min, as gguf's dequantization does in float32 (its d sc and
        dmin mn are exact products too), so the values are gguf's bit for bit."""
        tb = self.bits.tile_bytes
        low = six_high(q[..., :8]).int()  # the 2-bit fields
        scale_bytes = q[..., tb:].repeat_interleave(16, dim=-1)  # [R, G, 32]: each half's
        if self.bits == Bits.INT3:
            values = low + 4 * three_high(q[..., 8:12]).int() - 4
            return d.float()[..., None] * (scale_bytes.view(torch.int8).int() * values).float()
        scaled = ((scale_bytes & 0xF).int() * low).float()
        return d.float()[..., None] * scaled - m.float()[..., None] * (scale_bytes >> 4).float()


def high_bits(qh: torch.Tensor) -> torch.Tensor:
    """5-bit groups' high bits qh uint8 [..., 4] (bit k of the little-endian word: input k's)
    as the values they add, uint8 [..., 32] of 16 or 0."""
    bits = qh[..., :, None].int() >> torch.arange(8, dtype=torch.int32)
    return ((bits & 1) << 4).reshape(*qh.shape[:-1], GROUP).to(torch.uint8)


def six_high(qh: torch.Tensor) -> torch.Tensor:
    """6-bit groups' top 2 bits (and the `SUB_SCALED` widths' 2-bit fields) qh uint8 [..., 8]
    as values 0..3, uint8 [..., 32]: a half's 4
    bytes (the first half's, then the second's), byte b holding inputs b, 4 + b, 8 + b and
    12 + b of the half at bits 0-1, 2-3, 4-5 and 6-7 (so the kernel shifts once a vector)."""
    halves = qh.reshape(*qh.shape[:-1], 2, 1, 4).int()  # [..., half, 1, b]
    top = (halves >> (2 * torch.arange(4, dtype=torch.int32))[:, None]) & 3  # [..., half, q, b]
    return top.reshape(*qh.shape[:-1], GROUP).to(torch.uint8)


def three_high(qh: torch.Tensor) -> torch.Tensor:
    """INT3 groups' high bits qh uint8 [..., 4] as values 0 or 1, uint8 [..., 32]: bit j of byte
    b is input 4j + b's (so the kernel's one shift by q, or 4 + q, brings vector q's to bit 0
    of every byte)."""
    bits = qh[..., None, :].int() >> torch.arange(8, dtype=torch.int32)[:, None]  # [..., j, b]
    return (bits & 1).reshape(*qh.shape[:-1], GROUP).to(torch.uint8)


def three_high_packed(high: torch.Tensor) -> torch.Tensor:
    """`three_high`'s inverse: values 0 or 1 uint8 [..., 32] -> the 4 bytes that hold them."""
    parts = high.reshape(*high.shape[:-1], 8, 4).int()  # [..., j, b]
    shifts = torch.arange(8, dtype=torch.int32)[:, None]
    return (parts << shifts).sum(-2).to(torch.uint8)


def six_high_packed(top: torch.Tensor) -> torch.Tensor:
    """`six_high`'s inverse: values 0..3 uint8 [..., 32] -> the 8 bytes that hold them."""
    parts = top.reshape(*top.shape[:-1], 2, 4, 4)  # [..., half, q, b]: bytes, bits apart
    packed = parts[..., 0, :] | (parts[..., 1, :] << 2) | (parts[..., 2, :] << 4)
    return (packed | (parts[..., 3, :] << 6)).reshape(*top.shape[:-1], 8)


@dataclass
class QuantizedRows:
    """Activations [M, K] as the kernel quantizes them: int8 values [M, G * 32], and each
    group's scale and sum (of the quantized values) [M, G]."""

    values: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor


def int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 32 weights w [N, G, 32] float32 by Q8_0's rule: q int8 [N, G, 32] in [-127,
    127] and d float16 [N, G], w ~ d q (the largest magnitude maps to 127)."""
    d = (w.abs().amax(dim=2) / 127).half()
    inv = torch.where(d == 0, 0.0, 1 / d.float())
    return torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8), d


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """The kernel's own activation quantization of x [M, K] float32 (for tests and callers that
    want to see it)."""
    x = x.contiguous()
    m, k = x.shape
    groups = -(-k // GROUP)
    rows = QuantizedRows(
        torch.empty(m, groups * GROUP, dtype=torch.int8),
        torch.empty(m, groups),
        torch.empty(m, groups),
    )
    for i in range(m):
        native.built(_library()).quantize_row(
            x[i].data_ptr(),
            rows.values[i].data_ptr(),
            rows.scales[i].data_ptr(),
            rows.sums[i].data_ptr(),
            k,
            groups,
        )
    return rows


def grouped_linear(
    x: torch.Tensor,
    w: PackedGroups,
    bias: torch.Tensor | None,
    isa: cpu_isa.Isa = cpu_isa.Isa.AVX2,
) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32, on `isa`'s kernel (every path gives the same
    bits). Lean on purpose, like `int8_gemm.int8_linear`: at batch 1 this wrapper's own
    microseconds add up over every linear of a step."""
    x = x.contiguous()
    m, groups = x.shape[0], w.groups
    lib = native.built(_library(isa))
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    if w.half:  # no scratch: the activations stay float
        lib.half_linear(
            x.data_ptr(),
            w.tiles_ptr,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            w.out_features,
            w.in_features,
            groups * GROUP,
            int(w.bits),
        )
        return out
    # the widths AMX lacks: their entry points are their VNNI code there
    amx = isa is cpu_isa.Isa.AMX and m >= AMX_MIN_ROWS and w.bits in AMX_WIDTHS
    rows = -(-m // 16) * 16 if amx else m  # the tile unit reads activations 16 rows at a time
    a = torch.empty(rows, groups * GROUP, dtype=torch.int8)
    xs = torch.empty(rows, groups, dtype=torch.float32)
    xsum = torch.empty(rows, groups, dtype=torch.float32)
    if w.bits == Bits.INT4:
        run = lib.int4_linear_amx if amx else lib.int4_linear
    elif w.bits == Bits.INT5:
        run = lib.int5_linear_amx if amx else lib.int5_linear
    elif w.bits == Bits.INT6:
        run = lib.int6_linear
    elif w.bits == Bits.INT3:
        run = lib.int3_linear
    elif w.bits == Bits.INT2:
        run = lib.int2_linear
    elif w.bits == Bits.IQ4:
        run = lib.iq4_linear_amx if amx else lib.iq4_linear
    else:
        run = lib.q8_linear_amx if amx else lib.q8_linear
    run(
        x.data_ptr(),
        a.data_ptr(),
        xs.data_ptr(),
        xsum.data_ptr(),
        w.tiles_ptr,
        w.scales_ptr,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        w.out_features,
        w.in_features,
        groups,
        w.offsets,
    )
    return out
