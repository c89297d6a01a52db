"""LoRA deltas of mixed-adapter batches without a model: the segment grouping, the CPU's batched
path and the Triton SGMV kernel (interpreted) against the row-by-row definition."""

import os

# before triton.jit runs on import of the kernel (conftest does it too)
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from radixrt.kernels.lora import Segments, batched, dense_reference  # noqa: E402

IN, OUT, SLOTS, PER_SLOT = 40, 24, 4, 8  # widths no power of two: every tile is masked


def test_segments_group_rows_by_slot_and_leave_the_base_out():
    seg = Segments.of([2, -1, 0, 2, 0, -1, 3])
    assert seg.slots == [0, 2, 3]
    assert seg.order.tolist() == [2, 4, 0, 3, 6]  # rows ascending within a slot
    assert list(zip(seg.starts, seg.ends)) == [(0, 2), (2, 4), (4, 5)]
    assert seg.gather.tolist() == [2, 4, 0, 3, 6, 0]  # padded to 2 rows a segment, with row 0
    assert seg.keep.flatten().tolist() == [1, 1, 1, 1, 1, 0]
    assert Segments.of([-1, -1]).slots == []


def _weights(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, IN, PER_SLOT, generator=g).to(dtype)
    b = torch.randn(SLOTS, PER_SLOT, OUT, generator=g).to(dtype)
    return a, b


def _rows(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, SLOTS, (n,), generator=g).tolist()


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_cpu_path_equals_the_dense_definition(rows):
    """Uneven segments (padded), slots not 0..n-1 (gathered), base rows untouched."""
    a, b = _weights(rows)
    x, base = torch.randn(rows, IN), torch.randn(rows, OUT)
    row_slots = _rows(rows, rows + 1)
    want = base + dense_reference(x, a, b, row_slots)
    got = batched(base.clone(), x, a, b, Segments.of(row_slots))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for t in [i for i, s in enumerate(row_slots) if s < 0]:
        assert torch.equal(got[t], base[t])


def test_cpu_path_over_the_leading_slots_uses_views():
    a, b = _weights(9)
    x, row_slots = torch.randn(8, IN), [0, 1, 0, 1, 1, -1, 0, 1]
    seg = Segments.of(row_slots)
    assert seg.slots == [0, 1] and seg.longest == 4
    got = batched(torch.zeros(8, OUT), x, a, b, seg)
    torch.testing.assert_close(got, dense_reference(x, a, b, row_slots), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_sgmv_kernel_equals_the_cpu_path(rows):
    from radixrt.kernels.lora_sgmv import lora_sgmv_fwd

    a, b = _weights(rows + 7)
    x = torch.randn(rows, IN)
    seg = Segments.of(_rows(rows, rows))
    base = torch.randn(rows, OUT)
    got = lora_sgmv_fwd(base.clone(), x, a, b, seg)
    want = batched(base.clone(), x, a, b, seg)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sgmv_kernel_in_half_precision():
    """fp16 in, fp32 accumulation, fp16 out (fp16 stands in for bf16 under the interpreter)."""
    from radixrt.kernels.lora_sgmv import lora_sgmv_fwd

    a, b = (w.half().float() / 4 for w in _weights(3))
    x = torch.randn(9, IN).half().float()
    row_slots = _rows(9, 4)
    want = dense_reference(x, a, b, row_slots)
    seg = Segments.of(row_slots)
    got = lora_sgmv_fwd(torch.zeros(9, OUT).half(), x.half(), a.half(), b.half(), seg)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=1e-2)
