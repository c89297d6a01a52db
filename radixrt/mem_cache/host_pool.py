"""The host tier's KV pool: evicted prefixes and swapped-out requests in host memory.

Paged like the device pool (same page size, page 0 reserved) so a node's host slots are whole
pages. Its buffers have the device pool's shapes and dtype, so a quantized pool's rows (codes
and scales, `kv_quant`) are held and moved as they are, never re-quantized. On CUDA the buffers are pinned so copies are DMA transfers; on the CPU a copy is a memcpy
between two buffers of the same memory.
"""

from __future__ import annotations

import torch

from radixrt.mem_cache.memory_pool import PageAllocator, TokenToKVPool
from radixrt.mem_cache.storage import BlockKV


class HostKVPool:
    """Per-layer K and V buffers in host memory and their page allocator; copies by slot index
    to and from the device pool `device_pool`."""

    def __init__(self, device_pool: TokenToKVPool, num_tokens: int, page_size: int):
        self.device_pool = device_pool
        self.allocator = PageAllocator(num_tokens, page_size, torch.device("cpu"))
        k0 = device_pool.k_buffers[0]
        self.on_cuda = k0.is_cuda
        shape = (self.allocator.num_slots, *k0.shape[1:])
        self.k_buffers = [self._buffer(shape, k0.dtype) for _ in device_pool.k_buffers]
        self.v_buffers = [self._buffer(shape, k0.dtype) for _ in device_pool.v_buffers]

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # empty: pages are touched only when used, so a large tier costs nothing until filled
        return torch.empty(shape, dtype=dtype, pin_memory=self.on_cuda)

    @property
    def total_tokens(self) -> int:
        return self.allocator.total_tokens

    def available(self) -> int:
        return self.allocator.available()

    def used_tokens(self) -> int:
        return self.allocator.total_tokens - self.allocator.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """Slots for n tokens in whole pages of their own; None when the pool is short."""
        return self.allocator.alloc_extend(0, 0, n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def write(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the device KV at `device_slots` to `host_slots`, every layer."""
        device_slots = device_slots.to(self.device_pool.k_buffers[0].device)
        for src, dst in self._pairs():
            dst.index_copy_(0, host_slots, src.index_select(0, device_slots).cpu())

    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the host KV at `host_slots` into the device pool at `device_slots`, every layer."""
        device = self.device_pool.k_buffers[0].device
        device_slots = device_slots.to(device)
        for dst, src in self._pairs():
            block = src.index_select(0, host_slots)
            dst.index_copy_(0, device_slots, block.to(device, non_blocking=self.on_cuda))
        if self.on_cuda:  # the host blocks must outlive their transfer
            torch.cuda.current_stream().synchronize()

    def device_block(self, device_slots: torch.Tensor) -> BlockKV:
        """The device KV at `device_slots` as one block on the host (for the disk tier)."""
        pool = self.device_pool
        device_slots = device_slots.to(pool.k_buffers[0].device)
        k = torch.stack([buf.index_select(0, device_slots) for buf in pool.k_buffers])
        v = torch.stack([buf.index_select(0, device_slots) for buf in pool.v_buffers])
        return BlockKV(k.cpu(), v.cpu())

    def put(self, host_slots: torch.Tensor, blocks: list[BlockKV], skip: int) -> None:
        """Write consecutive blocks, less their first `skip` tokens, to `host_slots`."""
        k = torch.cat([block.k for block in blocks], dim=1)[:, skip:]
        v = torch.cat([block.v for block in blocks], dim=1)[:, skip:]
        for layer, (k_buf, v_buf) in enumerate(zip(self.k_buffers, self.v_buffers)):
            k_buf.index_copy_(0, host_slots, k[layer])
            v_buf.index_copy_(0, host_slots, v[layer])

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device buffer, host buffer) for every layer's K then V."""
        pool = self.device_pool
        return list(zip(pool.k_buffers + pool.v_buffers, self.k_buffers + self.v_buffers))


def host_pool_tokens(
    device_tokens: int, ratio: float, size_gb: float | None, device_pool: TokenToKVPool
) -> int:
    """Tokens of the host tier: `size_gb` of KV when given, else `ratio` times the device pool."""
    if size_gb is None:
        return int(device_tokens * ratio)
    return int(size_gb * 2**30 / device_pool.bytes_per_token)
