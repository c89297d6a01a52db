"""The C kernels for the CPU on their own, without a model, against plain torch (float64 where
the kernel's own rounding is the question)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_fused, cpu_isa, cpu_layer, cpu_paged, int4_gemm, int8_gemm, native
from radixrt.kernels.cpu_isa import Isa

needs_int8 = pytest.mark.skipif(not int8_gemm.available(), reason="needs AVX2 and a C compiler")
needs_int4 = pytest.mark.skipif(not int4_gemm.available(), reason="needs AVX2 and a C compiler")
# every native `--cpu-isa` path: each kernel test runs on each path this host has; one it lacks
# is a skip that names it (the AVX2 path runs on every host the project is built on)
NATIVE_PATHS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in cpu_isa.host_paths(), reason=f"this CPU lacks {isa.value}"
        ),
    )
    for isa in cpu_isa.NEEDS
]


@pytest.mark.parametrize(
    "hq, hkv, d, lens, cap",
    [
        (4, 4, 16, [70, 1, 0, 33], None),
        (9, 3, 64, [70, 1, 0, 33], None),
        (8, 1, 80, [70, 1, 0, 33], None),
        (9, 3, 64, [2000], None),  # one long context: its keys cut into ranges for both cores
        (8, 1, 64, [1500, 1], None),  # and with a range of the short one empty
        (9, 3, 64, [70, 1, 0, 33], 2.0),  # scores soft-capped (Gemma 2), below their raw max
    ],
)
def test_paged_decode_kernel_reads_the_pool_in_place(hq, hkv, d, lens, cap):
    """The kernel alone against float64 math over gathered rows, with scattered slots, ragged
    lengths (one row empty: no keys, lse -inf), GQA groups and soft-capped scores."""
    gen = torch.Generator().manual_seed(hq * 100 + d)
    k, v = torch.randn(3000, hkv, d, generator=gen), torch.randn(3000, hkv, d, generator=gen)
    lens = torch.tensor(lens)
    slots = torch.randint(1, 3000, (len(lens), int(lens.max())), generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen) * 3  # peaked softmaxes too
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # an xdist worker has one: the long cases split for two
    try:
        if int(lens.max()) >= 2 * cpu_paged.MIN_SPLIT_KEYS:
            assert cpu_paged.choose_splits(len(lens) * hkv, int(lens.max())) > 1
        out, lse = cpu_paged.paged_decode(q, k, v, slots, lens, cap)
    finally:
        torch.set_num_threads(threads)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            assert torch.isinf(lse[b]).all() and lse[b].max() < 0 and (out[b] == 0).all()
            continue
        kb = k[slots[b, :n]].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vb = v[slots[b, :n]].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        scores = (q[b].double()[:, None, :] @ kb.transpose(1, 2)).squeeze(1) / d**0.5
        if cap:
            assert scores.max() > cap
            scores = cap * torch.tanh(scores / cap)
        torch.testing.assert_close(lse[b].double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        expected = (scores.softmax(-1)[:, None, :] @ vb).squeeze(1)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


@needs_int8
@pytest.mark.parametrize(
    "m, n, k", [(1, 5, 7), (2, 33, 40), (3, 960, 576), (4, 96, 64), (7, 576, 1536), (64, 130, 96)]
)
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_int8_linear_matches_its_dequantized_weight(m, n, k, isa):
    """Any row count (tiles of 3 rows and their remainders), outputs not a multiple of the tile,
    inputs not a multiple of 32, with a bias; the only error left is the activations' int16
    rounding, about 1e-5 of each row's largest value. Every path gives avx2's bits (its integer
    sums are exact)."""
    gen = torch.Generator().manual_seed(m * n + k)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n)
    packed = int8_gemm.PackedInt8.quantize(w)
    expected = x.double() @ packed.dequantize().double().T + bias.double()
    out = int8_gemm.int8_linear(x, packed, bias, isa)
    assert out.shape == (m, n)
    torch.testing.assert_close(
        out.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max())
    )
    assert torch.equal(out, int8_gemm.int8_linear(x, packed, bias, Isa.AVX2))


@needs_int8
def test_int8_quantization_rounds_each_channel_to_half_a_step():
    w = (
        torch.randn(70, 100) * torch.logspace(-3, 2, 70)[:, None]
    )  # channels of very different sizes
    packed = int8_gemm.PackedInt8.quantize(w)
    step = w.abs().amax(dim=1) / 127
    assert ((packed.dequantize() - w).abs() <= step[:, None] * 0.5 + 1e-6 * step[:, None]).all()


@needs_int8
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_int8_long_sums_do_not_overflow(isa):
    """Every product at its largest, 5,000 of them: past int32 unless the kernel flushes its
    integer sums to float every 2,048 inputs."""
    k = 5000
    packed = int8_gemm.PackedInt8.quantize(torch.ones(4, k))
    out = int8_gemm.int8_linear(torch.full((1, k), 3.0), packed, None, isa)
    torch.testing.assert_close(out, torch.full((1, 4), 3.0 * k))


def _grouped_reference(x: torch.Tensor, w: int4_gemm.PackedGroups, bias) -> torch.Tensor:
    """What the grouped kernel computes, in float64: the activations as the kernel quantizes
    them (checked on their own by `test_activation_quantization_is_round_to_nearest`) times
    d q; plus the offsets m times the exact activations' group sums (the `SUB_SCALED` widths:
    none, INT2's mins meet the quantized activations' halves, as the rest of the weight)."""
    m, k = x.shape
    rows = int4_gemm.quantize_rows(x)
    groups = rows.scales.shape[1]
    xq = rows.values.double().view(m, groups, 32) * rows.scales.double()[..., None]
    offsets = w.blocks()[2]
    if w.bits in int4_gemm.SUB_SCALED:
        offsets = torch.zeros_like(offsets)
    dq = w.dequantize().double() - offsets.double().repeat_interleave(32, 1)[:, :k]
    return (
        xq.view(m, -1)[:, :k] @ dq.T
        + rows.sums.double() @ offsets.double().T
        + (0 if bias is None else bias.double())
    )


@needs_int4
def test_activation_quantization_is_round_to_nearest():
    """The kernel's int8 activations are exactly float32's round(x * (1 / s)), s = max |x| / 127
    per group of 32 (ties to even), zero past K; a group of zeros has s = 1; a group's sum is
    the quantized values' (s times their integer sum), which offsets multiply."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 100, generator=gen) * torch.logspace(-4, 3, 5)[:, None]
    x[1, 32:64] = 0
    x[2, :32] = torch.arange(32) - 15.5  # halves: ties
    rows = int4_gemm.quantize_rows(x)
    padded = torch.zeros(5, 128)
    padded[:, :100] = x
    groups = padded.view(5, 4, 32)
    top = groups.abs().amax(2)
    s = torch.where(top > 0, top / 127, 1.0)
    q = torch.round(groups * (1 / s)[..., None]).to(torch.int8).view(5, 128)
    assert torch.equal(rows.values, q)
    assert torch.equal(rows.scales, s)
    assert torch.equal(rows.sums, s * q.view(5, 4, 32).sum(2, dtype=torch.int32).float())


@needs_int4
@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 5, 7),
        (2, 33, 40),
        (3, 960, 576),
        (4, 96, 64),
        (5, 130, 95),
        (7, 17, 64),
        (8, 40, 256),
        (13, 9, 160),
        (16, 24, 64),
        (33, 130, 95),
        (64, 70, 33),
        (70, 24, 8192),
    ],
)
@pytest.mark.parametrize(
    "kind",
    ["asymmetric", "symmetric", "iq4", "q5", "q5 offsets", "q6", "q8", "q8 offsets", "q3", "q2"],
)
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_grouped_linear_matches_its_dequantized_weight(m, n, k, kind, isa):
    """Any row count (one tile to 3 rows; tiles of 4 rows and their remainders; 16 and more
    rows, AMX's tiles of 16 activation rows, in pairs, with their padding; 70 rows of 8,192
    inputs: three blocks of 32 rows), outputs not a multiple of the panel of 8, inputs one
    short of, one past or inside a group, with and without a bias; 4-bit both ways and signed
    8-bit groups (GGUF's Q8_0, values to -128, the largest products; and with offsets of their
    own, as asymmetric 8-bit checkpoints give); 5-bit groups (GGUF's Q5_0, and with offsets:
    Q5_1, Q5_K), 6-bit ones (Q6_K's: signed, a d for each half), IQ4_NL's levels, and the
    `SUB_SCALED` widths (Q3_K's 3-bit values and Q2_K's 2-bit ones and mins, an integer scale
    for each half: any byte, past the files' ranges), random bytes, so every value occurs.
    Every path gives avx2's bits: each sums a group's products exactly, in int16 pairs or in
    int32; and a row computed alone gets the bits it gets in the batch."""
    gen = torch.Generator().manual_seed(m * n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if m % 2 else None
    if kind.startswith(("q8", "q5", "q6", "iq4", "q3", "q2")):
        groups = -(-k // 32)
        bits = int4_gemm.Bits.IQ4 if kind == "iq4" else int4_gemm.Bits(int(kind[1]))
        q = torch.randint(0, 256, (n, groups, bits.group_bytes), dtype=torch.uint8, generator=gen)
        halves = (2,) if bits == int4_gemm.Bits.INT6 else ()  # 6 bits: a d for each half
        d = (torch.rand(n, groups, *halves, generator=gen) / 64).half()
        offsets = (
            (torch.randn(n, groups, generator=gen) / 8).half()
            if kind.endswith("offsets") or bits == int4_gemm.Bits.INT2  # INT2's m: dmin
            else None
        )
        packed = int4_gemm.PackedGroups.from_blocks(q, d, offsets, k, bits)
    else:
        packed = int4_gemm.PackedGroups.quantize(w, symmetric=kind == "symmetric")
    expected = _grouped_reference(x, packed, bias)
    out = int4_gemm.grouped_linear(x, packed, bias, isa)
    assert out.shape == (m, n)
    torch.testing.assert_close(
        out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )
    assert torch.equal(out, int4_gemm.grouped_linear(x, packed, bias, Isa.AVX2))
    for i in (0, m - 1):
        assert torch.equal(
            out[i : i + 1], int4_gemm.grouped_linear(x[i : i + 1], packed, bias, isa)
        )


@needs_int4
@pytest.mark.parametrize("bits", [int4_gemm.Bits.INT4, int4_gemm.Bits.INT8])
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_implied_offsets_give_the_bits_of_stored_ones(bits, isa):
    """The symmetric forms (Q4_0, 8-bit groups) stored without their offsets give the same
    outputs, bit for bit, as with -8 d (or 0) stored: the kernel's -8 d is exact."""
    gen = torch.Generator().manual_seed(bits)
    w, x = torch.randn(40, 200, generator=gen), torch.randn(5, 200, generator=gen)
    implied = int4_gemm.PackedGroups.quantize(w, bits, symmetric=True)
    q, d, m = implied.blocks()
    stored = int4_gemm.PackedGroups.from_blocks(q, d, m, 200, bits)
    assert stored.offsets and not implied.offsets and stored.nbytes - implied.nbytes == 5 * 7 * 16
    assert torch.equal(implied.dequantize(), stored.dequantize())
    out = int4_gemm.grouped_linear(x, implied, None, isa)
    assert torch.equal(out, int4_gemm.grouped_linear(x, stored, None, isa))


@needs_int4
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_quantization_rounds_each_group_to_half_a_step(symmetric):
    """Groups of very different sizes, and a group of zeros: each weight within half a step
    (d) of its own value, plus float16's rounding of d and m; the layout round-trips. Symmetric
    (Q4_0's rule) clamps the side opposite the largest magnitude at 7 d: a whole step there."""
    w = torch.randn(9, 100) * torch.logspace(-3, 2, 9)[:, None]
    w[3, 32:64] = 0
    packed = int4_gemm.PackedGroups.quantize(w, symmetric=symmetric)
    step = packed.blocks()[1].float().abs().repeat_interleave(32, 1)[:, :100]
    error = (packed.dequantize() - w).abs()
    half = 1.0 if symmetric else 0.5
    assert (error <= step * half + 2e-3 * w.abs().amax(1, keepdim=True)).all()
    assert (packed.dequantize()[3, 32:64] == 0).all()
    # 16 rows (9 padded to two panels of 8) of 4 groups: 0.625 B a weight, 0.5625 symmetric
    # (Q4_0's: the offset -8 d implied, not stored)
    assert packed.nbytes == 16 * 4 * (16 + (2 if symmetric else 4))


@pytest.mark.parametrize("rows", [1, 40])  # one thread, and the parallel loop
def test_fused_rms_norm_adds_the_residual_in_place(rows):
    if not cpu_fused.supports(torch.zeros(1)):
        pytest.skip("no C compiler")
    x, residual, weight = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    stream = residual + x
    torch.testing.assert_close(
        cpu_fused.rms_norm(x, weight, 1e-6), F.rms_norm(x, (96,), weight, 1e-6)
    )
    out = cpu_fused.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(residual, stream, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(stream, (96,), weight, 1e-6))


@pytest.mark.parametrize("rows", [1, 40])
def test_fused_rope_rotates_q_and_stores_k_and_v_in_the_pool(rows):
    """HF's rotate_half convention, GQA (6 query heads over 2 KV heads), scattered slots."""
    if not cpu_fused.supports(torch.zeros(1)):
        pytest.skip("no C compiler")
    hq, hkv, d = 6, 2, 16
    qkv = torch.randn(rows, (hq + 2 * hkv) * d)
    angles = torch.randn(rows, d // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    k_buf, v_buf = torch.zeros(100, hkv, d), torch.zeros(100, hkv, d)
    slots = torch.randperm(100)[:rows]
    q = cpu_fused.rope_and_store(qkv, cos, sin, hq, k_buf, v_buf, slots)

    def rotate(x):  # [rows, H, D]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]

    q_ref, k_ref, v_ref = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(q, rotate(q_ref.view(rows, hq, d)), rtol=0, atol=0)
    torch.testing.assert_close(k_buf[slots], rotate(k_ref.reshape(rows, hkv, d)), rtol=0, atol=0)
    torch.testing.assert_close(v_buf[slots], v_ref.reshape(rows, hkv, d), rtol=0, atol=0)
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert (k_buf[untouched] == 0).all() and (v_buf[untouched] == 0).all()


def test_fused_silu_mul():
    if not cpu_fused.supports(torch.zeros(1)):
        pytest.skip("no C compiler")
    gate_up = torch.randn(33, 2 * 50) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), F.silu(gate) * up)


def test_a_missing_c_compiler_is_a_warning_and_a_torch_fallback(monkeypatch, caplog):
    """Without a C compiler every kernel is off (None: callers keep their torch path) and the
    runtime says so once, as a warning, naming the fix."""
    from radixrt.kernels import native

    monkeypatch.setenv("CC", "no-such-compiler-radixrt")
    native.find_compiler.cache_clear()
    native.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=native.__name__):
            assert native.load("probe", "void f(void) {}", (("f", ()),)) is None
            assert native.find_compiler() is None
        warnings = [r for r in caplog.records if "no C compiler" in r.getMessage()]
        assert len(warnings) == 1 and "gcc" in warnings[0].getMessage()
    finally:
        monkeypatch.undo()
        native.find_compiler.cache_clear()
        native.load.cache_clear()


@pytest.mark.skipif(native.find_compiler() is None, reason="needs a C compiler")
def test_every_native_path_builds_on_any_host():
    """Each path's kernels compile (and load) wherever there is a compiler, so a path is never
    first built on the host that needs it: avx-vnni's among them, which this project's hosts
    cannot run (its tests above run where the CPU has it)."""
    for isa in cpu_isa.NEEDS:
        for kernel in (int4_gemm, int8_gemm, cpu_layer):
            assert kernel._library(isa) is not None, f"{kernel.__name__} on {isa.value}"
