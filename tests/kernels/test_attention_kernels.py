import os

# before triton.jit runs on import of radixrt.kernels (conftest does it too)
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radixrt.kernels import (  # noqa: E402
    decode_attention,
    decode_attention_fwd,
    decode_attention_ref,
    extend_attention,
    extend_attention_fwd,
    extend_attention_ref,
)
from radixrt.mem_cache.kv_quant import KVFormat  # noqa: E402

from helpers import LaunchSpy  # noqa: E402

# (Hq, Hkv, D): GQA ratios 1, 3, 8 and power-of-two plus padded head dims.
HEAD_CASES = [(4, 4, 16), (6, 2, 32), (8, 1, 64), (3, 1, 128), (6, 2, 80), (3, 3, 48)]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _spy(monkeypatch, module, name: str) -> LaunchSpy:
    spy = LaunchSpy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    return spy


class TileSpy:
    """Stands in for `_attend_block`, which every key/value tile of both kernels passes through
    (the interpreter runs kernels as Python): records each tile's (query rows, key rows)."""

    def __init__(self, attend_block):
        self.attend_block = attend_block
        self.tiles: list[tuple[int, int]] = []

    def __call__(self, q, k, *rest):
        self.tiles.append((int(q.shape[0]), int(k.shape[0])))
        return self.attend_block(q, k, *rest)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _extend_tiles(prefix_lens, extend_lens, block_m, block_n) -> list[tuple[int, int]]:
    """Per query tile of every request: the tiles its prefix loop and its causal loop run."""
    return [
        (_cdiv(p, block_n), _cdiv(min(m + block_m, e), block_n))
        for p, e in zip(prefix_lens, extend_lens)
        for m in range(0, e, block_m)
    ]


def _decode_tiles(context_lens, num_splits, block_n) -> list[int]:
    """Per non-empty split of every request: the tiles its loop runs."""
    tiles = []
    for n in context_lens:
        split_len = _cdiv(n, num_splits)
        for lo in range(0, n, split_len):
            tiles.append(_cdiv(min(lo + split_len, n) - lo, block_n))
    return tiles


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _pool(total: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """A KV pool with spare slots, plus `total` distinct slots scattered over it in random order."""
    slots = total + 17
    k_buffer = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv_indices = torch.randperm(slots, generator=gen)[:total].to(torch.int32)
    return k_buffer, v_buffer, kv_indices


def _as_stored(fmt: KVFormat | None, dtype: torch.dtype, *buffers: torch.Tensor):
    """The pool the kernel reads (`fmt`'s quantized rows, or the floats) and the float pool the
    reference reads (those rows dequantized: the values the kernel should see), per buffer."""
    if fmt is None:
        return buffers, buffers
    rows = tuple(fmt.quantize(b) for b in buffers)
    return rows, tuple(fmt.dequantize(r, dtype) for r in rows)


def _strided_q(
    rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    # A view into a wider tensor (like q sliced out of a fused qkv projection): row stride != Hq * D.
    return torch.randn(rows, num_heads + 2, head_dim, generator=gen).to(dtype)[:, 1 : num_heads + 1]


def _run_extend(
    num_heads,
    num_kv_heads,
    head_dim,
    prefix_lens,
    extend_lens,
    logit_cap=0.0,
    dtype=torch.float32,
    sliding_window=None,
    fmt=None,
):
    gen = torch.Generator().manual_seed(sum(prefix_lens) * 31 + head_dim)
    k_buffer, v_buffer, kv_indices = _pool(sum(prefix_lens), num_kv_heads, head_dim, dtype, gen)
    stored, values = _as_stored(fmt, dtype, k_buffer, v_buffer)
    n = sum(extend_lens)
    q = _strided_q(n, num_heads, head_dim, dtype, gen)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    args = (q, k, v)
    meta = (_indptr(extend_lens), _indptr(prefix_lens), kv_indices, max(extend_lens))
    out = torch.full((n, num_heads, head_dim), float("nan"), dtype=dtype)
    ref = torch.empty_like(out)
    options = dict(logit_cap=logit_cap, sliding_window=sliding_window)
    kind = fmt.kernel_kind if fmt else None
    extend_attention_fwd(*args, out, *stored, *meta, **options, kv_kind=kind)
    extend_attention_ref(*args, ref, *values, *meta, **options)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def _run_decode(
    num_heads,
    num_kv_heads,
    head_dim,
    context_lens,
    num_kv_splits,
    logit_cap=0.0,
    dtype=torch.float32,
    sliding_window=None,
    fmt=None,
):
    gen = torch.Generator().manual_seed(sum(context_lens) * 31 + head_dim + num_kv_splits)
    k_buffer, v_buffer, kv_indices = _pool(sum(context_lens), num_kv_heads, head_dim, dtype, gen)
    stored, values = _as_stored(fmt, dtype, k_buffer, v_buffer)
    q = _strided_q(len(context_lens), num_heads, head_dim, dtype, gen)
    out = torch.full((len(context_lens), num_heads, head_dim), float("nan"), dtype=dtype)
    ref = torch.empty_like(out)
    meta = (_indptr(context_lens), kv_indices, num_kv_splits)
    options = dict(logit_cap=logit_cap, sliding_window=sliding_window)
    kind = fmt.kernel_kind if fmt else None
    decode_attention_fwd(q, *stored, out, *meta, **options, kv_kind=kind)
    decode_attention_ref(q, *values, ref, *meta, **options)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("heads", HEAD_CASES, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_extend_matches_reference(heads, logit_cap):
    _run_extend(*heads, prefix_lens=[0, 7, 29], extend_lens=[13, 1, 35], logit_cap=logit_cap)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_extend_multiple_blocks(monkeypatch, block_m, block_n):
    """Small tiles so the query, prefix and causal loops each run several tiles; the kernel was
    launched with the patched tile sizes (so the interpreter really covered those loops)."""
    monkeypatch.setattr(
        extend_attention, "_launch_config", lambda block_d: dict(BLOCK_M=block_m, BLOCK_N=block_n)
    )
    spy = _spy(monkeypatch, extend_attention, "_extend_kernel")
    tiles = TileSpy(extend_attention._attend_block)
    monkeypatch.setattr(extend_attention, "_attend_block", tiles)
    heads, prefix_lens, extend_lens = 6, [0, 21, 40], [37, 1, 18]
    _run_extend(heads, 2, 32, prefix_lens=prefix_lens, extend_lens=extend_lens, logit_cap=3.0)

    [(grid, kwargs)] = spy.launches
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) == (block_m, block_n)
    assert grid == (3, heads, _cdiv(max(extend_lens), block_m)) and grid[2] > 1, (
        "one query tile per request"
    )
    assert set(tiles.tiles) == {(block_m, block_n)}, (
        "the kernel ran with other tile sizes than patched"
    )
    expected = _extend_tiles(prefix_lens, extend_lens, block_m, block_n)
    assert max(p for p, _ in expected) > 1 and max(c for _, c in expected) > 1, (
        "a loop ran one tile only"
    )
    assert len(tiles.tiles) == heads * sum(p + c for p, c in expected), "tiles skipped or repeated"


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("heads", HEAD_CASES, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_decode_matches_reference(heads, num_kv_splits, logit_cap):
    # Context 1 and 3 leave some of the 4 splits empty.
    _run_decode(*heads, context_lens=[1, 37, 3], num_kv_splits=num_kv_splits, logit_cap=logit_cap)


def test_decode_multiple_blocks_per_split(monkeypatch):
    """A 16-key tile so a split spans several tiles; the kernel was launched with that tile and
    the requested splits, and some split's loop ran more than one tile."""
    monkeypatch.setattr(decode_attention, "_launch_config", lambda block_d: dict(BLOCK_N=16))
    spy = _spy(monkeypatch, decode_attention, "_decode_split_kernel")
    tiles = TileSpy(decode_attention._attend_block)
    monkeypatch.setattr(decode_attention, "_attend_block", tiles)
    _run_decode(8, 1, 64, context_lens=[39, 1, 70], num_kv_splits=3, logit_cap=4.0)
    # splits > context, non-power-of-two
    _run_decode(8, 1, 64, context_lens=[5, 2], num_kv_splits=7)

    assert [grid for grid, _ in spy.launches] == [(3, 1, 3), (2, 1, 7)]
    assert all(kwargs["BLOCK_N"] == 16 for _, kwargs in spy.launches)
    # 16 query rows: BLOCK_H
    assert set(tiles.tiles) == {(16, 16)}, "the kernel ran with another key tile than patched"
    expected = _decode_tiles([39, 1, 70], 3, 16) + _decode_tiles([5, 2], 7, 16)
    assert max(expected) > 1, "no split runs more than one tile"
    assert len(tiles.tiles) == sum(expected), "tiles skipped or repeated"


# windows of one key, shorter than a tile, across the prefix/new boundary, and longer than any
# sequence (the plain causal result)
@pytest.mark.parametrize("window", [1, 5, 24, 500])
def test_extend_within_a_sliding_window_matches_reference(monkeypatch, window):
    """Small tiles, so the window starts mid-tile and whole tiles before it are skipped."""
    monkeypatch.setattr(
        extend_attention, "_launch_config", lambda block_d: dict(BLOCK_M=16, BLOCK_N=16)
    )
    _run_extend(
        6, 2, 32, prefix_lens=[0, 21, 40, 3], extend_lens=[37, 1, 18, 2], sliding_window=window
    )
    _run_extend(4, 4, 16, prefix_lens=[9], extend_lens=[50], logit_cap=3.0, sliding_window=window)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 5, 37, 500])
def test_decode_within_a_sliding_window_matches_reference(monkeypatch, window, num_kv_splits):
    """The splits divide the window among them (16-key tiles: a split spans several)."""
    monkeypatch.setattr(decode_attention, "_launch_config", lambda block_d: dict(BLOCK_N=16))
    _run_decode(
        8, 2, 32, context_lens=[1, 37, 3, 90], num_kv_splits=num_kv_splits, sliding_window=window
    )


def test_a_sliding_window_skips_the_tiles_before_it(monkeypatch):
    """Decode with a 20-key window over 90 keys in 16-key tiles, one split: two tiles run (the
    window starts mid-tile), not six."""
    monkeypatch.setattr(decode_attention, "_launch_config", lambda block_d: dict(BLOCK_N=16))
    tiles = TileSpy(decode_attention._attend_block)
    monkeypatch.setattr(decode_attention, "_attend_block", tiles)
    _run_decode(4, 1, 16, context_lens=[90], num_kv_splits=1, sliding_window=20)
    assert len(tiles.tiles) == 2


def test_half_precision():
    # fp16 stands in for bf16 here: the interpreter's tl.dot multiplies bf16 tensors as their raw uint16 bits.
    # bf16 is checked on GPU by `radixrt bench --workload gpu-check`.
    _run_extend(8, 1, 64, prefix_lens=[0, 19], extend_lens=[9, 23], dtype=torch.float16)
    _run_decode(8, 1, 64, context_lens=[1, 33], num_kv_splits=4, dtype=torch.float16)


# (Hq, Hkv, D): GQA 3 and 1 with a head dim below its tile (80 of 128, 48 of 64)
QUANT_HEAD_CASES = [(6, 2, 80), (3, 3, 48)]


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("heads", QUANT_HEAD_CASES, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_quantized_pool_matches_reference_on_its_values(heads, fmt):
    """A quantized pool (`--kv-cache-dtype`): both kernels read its rows, codes times their
    scale, as the reference reads the same rows dequantized by `KVFormat.dequantize`; the
    extend's new tokens stay floats. Several splits and a sliding window included."""
    _run_extend(*heads, prefix_lens=[0, 7, 29], extend_lens=[13, 1, 35], logit_cap=5.0, fmt=fmt)
    _run_extend(*heads, prefix_lens=[40, 3], extend_lens=[5, 20], sliding_window=11, fmt=fmt)
    _run_decode(*heads, context_lens=[1, 37, 3], num_kv_splits=4, fmt=fmt)
    _run_decode(*heads, context_lens=[40, 9], num_kv_splits=3, sliding_window=11, fmt=fmt)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_quantized_pool_in_half_precision(fmt):
    """fp16 queries over a quantized pool: the dequantized tile is cast to the query's dtype."""
    _run_extend(8, 1, 64, prefix_lens=[19], extend_lens=[9], dtype=torch.float16, fmt=fmt)
    _run_decode(8, 1, 64, context_lens=[33], num_kv_splits=2, dtype=torch.float16, fmt=fmt)


def test_references_agree_with_dense_sdpa():
    """The references' paged layout gives the same result as dense causal attention over the whole sequence."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, prefix, extend = 6, 2, 32, 11, 5
    seq = prefix + extend
    q = torch.randn(seq, num_heads, head_dim, generator=gen)
    k = torch.randn(seq, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq, num_kv_heads, head_dim, generator=gen)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)

    # Prefix in scattered pool slots, last `extend` tokens new.
    slots = torch.randperm(seq + 4, generator=gen)[:prefix].to(torch.int32)
    k_buffer = torch.zeros(seq + 4, num_kv_heads, head_dim)
    v_buffer = torch.zeros_like(k_buffer)
    k_buffer[slots.long()], v_buffer[slots.long()] = k[:prefix], v[:prefix]
    out = torch.empty(extend, num_heads, head_dim)
    extend_attention_ref(
        q[prefix:],
        k[prefix:],
        v[prefix:],
        out,
        k_buffer,
        v_buffer,
        _indptr([extend]),
        _indptr([prefix]),
        slots,
        extend,
    )
    torch.testing.assert_close(out, dense[prefix:], atol=1e-5, rtol=1e-5)

    # Decoding the last token over the whole sequence in the pool.
    all_slots = torch.randperm(seq + 4, generator=gen)[:seq].to(torch.int32)
    k_buffer[all_slots.long()], v_buffer[all_slots.long()] = k, v
    out = torch.empty(1, num_heads, head_dim)
    decode_attention_ref(q[-1:], k_buffer, v_buffer, out, _indptr([seq]), all_slots)
    torch.testing.assert_close(out[0], dense[-1], atol=1e-5, rtol=1e-5)
