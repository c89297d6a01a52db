"""The GPU's weight-only GEMM (`kernels/packed_gemm.py`, interpreted on the CPU) against the
packed weight's own `dequantize()` and a float matmul: 4-, 5-, 6- and 8-bit groups and per-channel
int8, at row counts of a decode step (1, 3, 16) and a prefill chunk past one tile (70),
outputs that end mid-panel and mid-tile, inputs that end mid-group (the last group short, as
the CPU kernel handles it), decode's inputs cut in 2 and 3 parts (35 and 50 groups), with and
without a bias, and GPTQ's act-order (inputs gathered first)."""

import pytest
import torch

from radixrt.kernels import int4_gemm, int8_gemm
from radixrt.kernels.packed_gemm import launch_config, packed_linear_fwd
from radixrt.models import quantized


def _weight(kind: str, n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g) / k**0.5
    if kind == "int8":
        return int8_gemm.PackedInt8.quantize(w)
    if kind.startswith(("groups5", "groups6", "iq4")):  # Q5_0 (Q5_1/Q5_K), Q6_K, IQ4_NL
        groups = -(-k // 32)
        bits = int4_gemm.Bits.IQ4 if kind == "iq4" else int4_gemm.Bits(int(kind[6]))
        q = torch.randint(0, 256, (n, groups, bits.group_bytes), dtype=torch.uint8, generator=g)
        halves = (2,) if bits == int4_gemm.Bits.INT6 else ()  # 6 bits: a d for each half
        d = (torch.rand(n, groups, *halves, generator=g) / 64).half()
        m = (torch.randn(n, groups, generator=g) / 8).half() if kind.endswith("m") else None
        return int4_gemm.PackedGroups.from_blocks(q, d, m, k, bits)
    bits = int4_gemm.Bits.INT4 if kind == "int4" else int4_gemm.Bits.INT8
    return int4_gemm.PackedGroups.quantize(w, bits, symmetric=kind == "int4-sym")


@pytest.mark.parametrize(
    "kind", ["int4", "int4-sym", "iq4", "groups5", "groups5m", "groups6", "groups8", "int8"]
)
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 64, 64), (3, 75, 100), (70, 41, 160), (5, 136, 17), (2, 40, 1100), (16, 24, 1590)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_dequantize_and_matmul(kind, m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    w = _weight(kind, n, k, g)
    assert launch_config(m, -(-k // 32)).splits == {1100: 2, 1590: 3}.get(k, 1)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = packed_linear_fwd(x, w, b)
    want = torch.nn.functional.linear(x, w.dequantize(), b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "groups8", "int8"])
def test_packed_linear_in_half_precision(kind):
    """The GPU's dtypes: fp16 in, the integer weights exact in fp16, fp32 sums and scales,
    fp16 out: the float32 result's rounding (fp16 stands in for bf16: the interpreter's tl.dot
    multiplies bf16 tensors as their raw bits)."""
    g = torch.Generator().manual_seed(7)
    w = _weight(kind, 96, 1100, g)  # decode rows: the inputs cut in 2 parts
    x = torch.randn(9, 1100, generator=g).half()
    b = torch.randn(96, generator=g)
    got = packed_linear_fwd(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.dequantize(), b)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_groups_with_their_inputs_gathered(bits):
    """A GPTQ act-order weight (`PermutedGroups`: inputs sorted by group) multiplies the
    activations gathered by its `perm`, as `GroupedLinear` gathers them: the layer's own
    weight, whose groups are scattered over its inputs."""
    g = torch.Generator().manual_seed(bits)
    n, k, group = 40, 256, 64
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // group, generator=g) / 8
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    groups = torch.empty(k, dtype=torch.long)
    groups[torch.randperm(k, generator=g)] = torch.arange(k) // group
    packed = quantized._to_groups(quantized.GroupInts(q, scale, zero, groups), bits)
    assert isinstance(packed, quantized.PermutedGroups)
    layer = torch.empty(n, k)
    layer[:, packed.perm] = packed.weight.dequantize()
    x = torch.randn(6, k, generator=g)
    got = packed_linear_fwd(x.index_select(1, packed.perm), packed.weight, None)
    torch.testing.assert_close(got, x @ layer.T, atol=1e-4, rtol=1e-5)
