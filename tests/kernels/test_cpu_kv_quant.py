"""The quantized KV rows (`--kv-cache-dtype`) on their own, without a model: the C decode kernel
over int8 and fp8 pools against float64 math over the same rows dequantized by torch, and the C
int8 writer against `KVFormat.quantize`, byte for byte; the rotation int8 rows are stored
under."""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels import cpu_paged
from radixrt.mem_cache.kv_quant import KVFormat, rotation


@pytest.mark.parametrize("fmt", list(KVFormat))
@pytest.mark.parametrize(
    "hq, hkv, d, lens, cap",
    [
        (9, 3, 64, [70, 1, 0, 33], None),
        (8, 1, 128, [1500, 1], None),  # a long context cut into ranges, one range empty
        (4, 4, 16, [40, 7], 2.0),  # soft-capped scores
    ],
)
def test_quantized_decode_reads_the_rows_torch_dequantizes(fmt, hq, hkv, d, lens, cap):
    """Every code kind decoded in C as torch decodes it (subnormal and signed fp8 codes among
    them: values span four decades), attended as the float kernel attends."""
    gen = torch.Generator().manual_seed(d)
    span = 10.0 ** torch.empty(2, 3000, hkv, d).uniform_(-3, 1, generator=gen)
    k, v = (torch.randn(2, 3000, hkv, d, generator=gen) * span).unbind(0)
    kq, vq = fmt.quantize(k), fmt.quantize(v)
    lens = torch.tensor(lens)
    slots = torch.randint(1, 3000, (len(lens), int(lens.max())), generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    assert cpu_paged.supports_quantized(kq, d, torch.float32)
    out, lse = cpu_paged.paged_decode(q, kq, vq, slots, lens, cap, kind=fmt.kernel_kind)
    kf, vf = fmt.dequantize(kq, torch.float64), fmt.dequantize(vq, torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            assert torch.isinf(lse[b]).all() and (out[b] == 0).all()
            continue
        kb = kf[slots[b, :n]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vb = vf[slots[b, :n]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        scores = (q[b].double()[:, None, :] @ kb.transpose(1, 2)).squeeze(1) / d**0.5
        if cap:
            scores = cap * torch.tanh(scores / cap)
        torch.testing.assert_close(lse[b].double(), scores.logsumexp(-1), atol=1e-4, rtol=1e-5)
        expected = (scores.softmax(-1)[:, None, :] @ vb).squeeze(1)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-4, rtol=1e-4)


def test_c_int8_writer_writes_the_bytes_torch_does():
    """Rows of every magnitude, a row of zeros (scale 0) and ties at half a step: the C writer's
    bytes at their slots are `KVFormat.INT8.quantize`'s, other slots untouched."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 64, generator=gen) * 10.0 ** torch.randint(-4, 3, (37, 3, 1))
    x[5, 1] = 0
    x[6, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 exactly half a step: rounds to even
    buf = torch.full((100, 3, 68), 7, dtype=torch.int8)
    slots = torch.randperm(99, generator=gen)[:37] + 1
    cpu_paged.quantize_int8(x, slots, buf)
    assert torch.equal(buf[slots], KVFormat.INT8.quantize(x))
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert (buf[untouched] == 7).all()


@pytest.mark.parametrize("d", [64, 128, 80, 96])
def test_the_rotation_is_its_own_inverse_and_spreads_an_outlier(d):
    """`rotation(D)`, what an int8 pool's rows are stored times: orthonormal and symmetric
    (attention over rotated rows equals attention over the rows themselves), and a key with one
    outlier channel comes out with no channel above the block's share of it."""
    r = rotation(d).double()
    assert torch.equal(r, r.T)
    assert torch.allclose(r @ r, torch.eye(d, dtype=torch.float64), atol=1e-6)
    key = torch.zeros(d, dtype=torch.float64)
    key[3] = 100.0
    block = d & -d
    assert float((key @ r).abs().max()) == pytest.approx(100.0 / block**0.5)
