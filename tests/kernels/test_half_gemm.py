"""`int4_gemm`'s 16-bit widths (`Bits.F16`, `Bits.BF16`: GGUF's F16/BF16 linears at 2 bytes a
weight) on their own, without a model: the packing moves the values, the kernel converts them
exactly and multiplies them by float activations as torch does (float32, the weight upcast),
every native `--cpu-isa` path this host runs gives avx2's bits, and a row's result does not
depend on the rows computed beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_isa, int4_gemm
from radixrt.kernels.cpu_isa import Isa
from radixrt.kernels.int4_gemm import Bits, PackedGroups

pytestmark = pytest.mark.skipif(not int4_gemm.available(), reason="needs AVX2 and a C compiler")
# every native path: avx2's code, or AVX-512's (avx512-vnni and amx: two panels a vector); a
# path this host lacks is a skip that names it
NATIVE_PATHS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in cpu_isa.host_paths(), reason=f"this CPU lacks {isa.value}"
        ),
    )
    for isa in cpu_isa.NEEDS
]
DTYPES = [torch.float16, torch.bfloat16]


def _weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 5, 7),  # K under one pair of vectors, odd: the last input pairs with a zero
        (1, 2048, 2048),  # a decode row
        (2, 33, 40),  # K not a multiple of 32
        (3, 960, 576),  # the default model's width
        (4, 96, 65),
        (5, 130, 95),
        (6, 24, 1),  # one input
        (7, 17, 64),
        (8, 40, 256),  # a tile of 6 rows and 2 left
        (13, 9, 161),
        (70, 130, 2049),  # past a block of rows kept in L2
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_half_linear_matches_torch(m, n, k, dtype, isa):
    """Any row count (decode tiles of 1 and 2 rows over 4 panels, prefill tiles of up to 6, the
    rows of a block), outputs not a multiple of a panel (8) or of AVX-512's two, inputs odd or
    short of a group, with and without a bias: torch's float32 multiply of the upcast weight,
    within float32's summation order; every path gives avx2's bits."""
    gen = torch.Generator().manual_seed(m * n + k)
    w, x = _weight(n, k, dtype, gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if m % 2 else None
    packed = PackedGroups.from_halves(w)
    out = int4_gemm.grouped_linear(x, packed, bias, isa)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w.float(), bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, int4_gemm.grouped_linear(x, packed, bias, Isa.AVX2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, isa):
    """Each of 8 rows (a decode batch), and of 70 (prefill: tiles of 6 rows, a block of rows
    kept in L2, the remainders), computed alone and with the others: the same bits."""
    gen = torch.Generator().manual_seed(8)
    w, x = _weight(136, 2050, dtype, gen), torch.randn(70, 2050, generator=gen)
    bias = torch.randn(136, generator=gen)
    packed = PackedGroups.from_halves(w)
    for rows in (8, 70):
        together = int4_gemm.grouped_linear(x[:rows], packed, bias, isa)
        alone = [int4_gemm.grouped_linear(x[i : i + 1], packed, bias, isa) for i in range(rows)]
        assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_the_kernel_converts_every_value_exactly(dtype, isa):
    """Every finite 16-bit pattern (subnormals, the largest magnitudes, signed zeros) as a
    weight, multiplied by one-hot rows: out = w.T, each value converted exactly as torch's
    upcast converts it."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[values.float().isfinite()]
    k = 64
    w = values[: len(values) // k * k].view(-1, k)
    out = int4_gemm.grouped_linear(torch.eye(k), PackedGroups.from_halves(w), None, isa)
    assert torch.equal(out, w.float().T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_panels_hold_the_values_at_2_bytes_a_weight(dtype, monkeypatch):
    """`from_halves` moves the values (packed a few rows at a time: the same panels as at once):
    `dequantize` and `rows` (an embedding's lookup) give them back upcast; the panels hold 2
    bytes a weight (past N and K, zeros to the panel and the group) and no scales."""
    gen = torch.Generator().manual_seed(1)
    w = _weight(1003, 333, dtype, gen)
    packed = PackedGroups.from_halves(w)
    assert packed.bits == (Bits.F16 if dtype == torch.float16 else Bits.BF16) and packed.half
    assert torch.equal(packed.dequantize(), w.float())
    ids = torch.tensor([0, 7, 8, 1002, 500, 0])
    assert torch.equal(packed.rows(ids), w.float()[ids])
    assert packed.nbytes == 1008 * 352 * 2 and packed.scales.numel() == 0
    monkeypatch.setattr(int4_gemm, "QUANTIZE_BYTES", 352 * 2 * 8 * 3)  # 24 rows a chunk
    assert torch.equal(PackedGroups.from_halves(w).tiles, packed.tiles)


def test_16_bit_widths_come_from_their_values_only():
    """Rounding float weights to a 16-bit width is not `quantize`'s: the values come as stored."""
    with pytest.raises(ValueError, match="from_halves"):
        PackedGroups.quantize(torch.ones(8, 32), Bits.F16)
