"""The KV pool's memory on the CPU: a pool sized for its capacity holds, resident, only the pages
its tokens were written to (users see RSS at the size of what is served), reads as zeros
elsewhere, and comes back that way after a release."""

from __future__ import annotations

import os

import pytest
import torch

from radixrt.mem_cache.kv_quant import KVFormat
from radixrt.mem_cache.memory_pool import TokenToKVPool

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("fmt", [None, KVFormat.INT8])
def test_a_pool_is_resident_only_where_written(fmt):
    """A 2.3 GB float32 pool (0.6 GB as int8) adds a few MB at creation; 2,000 tokens written
    to every layer add about their own bytes; everything unwritten reads as zeros, and a
    release and restore gives zeros again, still not resident."""
    slots, layers, heads, dim = 100_000, 30, 3, 64
    before = _rss()
    pool = TokenToKVPool(slots, layers, heads, dim, torch.float32, torch.device("cpu"), fmt)
    capacity = sum(b.nbytes for b in pool.k_buffers + pool.v_buffers)
    assert capacity >= 500 * MB
    assert _rss() - before < 16 * MB
    n = 2000
    written = torch.arange(1, n + 1)
    for layer in range(layers):
        pool.set_kv(layer, written, torch.randn(n, heads, dim), torch.randn(n, heads, dim))
    used = 2 * layers * n * pool.k_buffers[0][0].nbytes
    assert _rss() - before < used + 32 * MB
    for b in (pool.k_buffers[0], pool.v_buffers[-1]):  # padding slot 0 and past the tokens
        assert bool(b[n + 1 :].eq(0).all()) and bool(b[0].eq(0).all())
    assert bool(pool.k_buffers[3][1 : n + 1].ne(0).any())
    pool.release()
    pool.restore()
    assert not pool.released and pool.k_buffers[0].shape == pool.shape
    assert all(bool(b.eq(0).all()) for b in (pool.k_buffers[0], pool.v_buffers[-1]))
