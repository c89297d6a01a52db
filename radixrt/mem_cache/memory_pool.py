"""The paged token pool: request->token table, per-layer K/V slots and the page allocator.

Who owns which slot, and how ownership moves between requests and the radix tree, is stated
and enforced in one place: `radixrt.mem_cache.slot_manager`. Page 0 is padding owned by nobody.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from radixrt.kernels import cpu_paged
from radixrt.mem_cache.kv_quant import KVFormat, rotation


class ReqToTokenPool:
    """Rows of slot indices: row r, column i is the KV slot of token i of the request in row r."""

    def __init__(self, rows: int, max_context: int, device: torch.device):
        self.req_to_token = torch.zeros((rows, max_context), dtype=torch.int32, device=device)
        self.rows = rows
        self._free_rows = list(range(rows - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def available(self) -> int:
        return len(self._free_rows)


class PageAllocator:
    """Hands out KV slots in pages of `page_size` consecutive slots; page 0 is reserved."""

    def __init__(self, total_tokens: int, page_size: int, device: torch.device):
        self.page_size = page_size
        self.num_pages = total_tokens // page_size
        self.total_tokens = self.num_pages * page_size
        self.device = device
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=device)
        self._pending: list[torch.Tensor] = []

    @property
    def num_slots(self) -> int:
        """Slots a KV buffer needs, the reserved page 0 included."""
        return (self.num_pages + 1) * self.page_size

    def available(self) -> int:
        """Free slots (whole free pages)."""
        self._merge_frees()
        return len(self._free_pages) * self.page_size

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        self._merge_frees()
        if num_pages > len(self._free_pages):
            return None
        pages, self._free_pages = self._free_pages[:num_pages], self._free_pages[num_pages:]
        return pages

    def alloc_extend(self, last_slot: int, cur_len: int, n: int) -> torch.Tensor | None:
        """Slots for tokens cur_len..cur_len+n-1 of one request whose token cur_len-1 is at `last_slot`.

        Tokens fill the request's last page first, so a page never mixes two owners' tokens.
        """
        p = self.page_size
        in_last_page = min((-cur_len) % p, n) if cur_len else 0
        head = torch.arange(
            last_slot + 1, last_slot + 1 + in_last_page, dtype=torch.int64, device=self.device
        )
        rest = n - in_last_page
        if rest == 0:
            return head
        pages = self.alloc_pages(-(-rest // p))
        if pages is None:
            return None
        tail = (pages[:, None] * p + torch.arange(p, device=self.device)).flatten()[:rest]
        return torch.cat([head, tail]) if in_last_page else tail

    def free(self, slots: torch.Tensor) -> None:
        """Free slots that start at a page boundary and cover whole pages (the last may be partial).

        Frees are only queued here and merged on the next allocation or count (one cat for many).
        """
        if len(slots):
            self._pending.append(slots[:: self.page_size] // self.page_size)

    def _merge_frees(self) -> None:
        if self._pending:
            self._free_pages = torch.cat([self._free_pages, *self._pending])
            self._pending.clear()

    def free_page_ids(self) -> torch.Tensor:
        self._merge_frees()
        return self._free_pages


def lazy_zeros(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    maps: list[mmap.mmap] | None = None,
) -> torch.Tensor:
    """A zero tensor whose memory, on the CPU, becomes resident only where it is written: an
    anonymous map reads as zeros and the kernel backs a page at its first write. A KV pool sized
    for the worst case then holds the memory of the tokens served so far, not of its capacity
    (torch.zeros writes every page: a 10% pool was resident at start). Elsewhere, torch.zeros.
    The map is added to `maps`, whose pages its owner may hand back (`drop_pages`)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapped = mmap.mmap(-1, nbytes)
    if maps is not None:
        maps.append(mapped)
    return torch.frombuffer(mapped, dtype=dtype).view(shape)


class TokenToKVPool:
    """Per-layer K and V buffers `[slots, kv_heads, head_dim]` of `dtype`, indexed by slot; with
    a quantized `fmt` (`--kv-cache-dtype`), `int8 [slots, kv_heads, head_dim + 4]` rows of codes
    and their scale (`kv_quant`; int8's of the K/V rows times `rotation`), which `set_kv` writes
    and readers dequantize (the values read are the rows as stored, rotated or not)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        fmt: KVFormat | None = None,
    ):
        self.fmt = fmt
        self.head_dim = head_dim
        self.dtype = dtype  # what readers compute in (the model's), whatever the pool stores
        # [D, D]: an int8 pool's rows are stored times it (`kv_quant.rotation`); None: as is
        self.rotation = rotation(head_dim).to(device, dtype) if fmt and fmt.rotated else None
        width = fmt.row_width(head_dim) if fmt else head_dim
        self.shape = (num_slots, num_kv_heads, width)
        self.num_layers = num_layers
        if fmt:
            dtype = torch.int8
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []  # the CPU buffers' anonymous maps (`lazy_zeros`)
        self._allocate(lambda: lazy_zeros(self.shape, dtype, device, self._maps))

    def _allocate(self, make: Callable[[], torch.Tensor]) -> None:
        self._maps = []
        self.k_buffers = [make() for _ in range(self.num_layers)]
        self.v_buffers = [make() for _ in range(self.num_layers)]

    @property
    def released(self) -> bool:
        return self.k_buffers[0].shape != self.shape

    def release(self) -> None:
        """Free every buffer's memory (`release_memory_occupation`): each becomes an empty
        tensor of the same dtype and device until `restore`; no KV may be read meanwhile."""
        dtype, device = self.k_buffers[0].dtype, self.k_buffers[0].device
        self._allocate(lambda: torch.empty(0, dtype=dtype, device=device))
        if device.type == "cuda":  # back to the device, for a trainer sharing it
            torch.cuda.empty_cache()

    def restore(self) -> None:
        """The buffers again, zeroed, after `release` (a no-op when they are there)."""
        if self.released:
            k = self.k_buffers[0]
            self._allocate(lambda: lazy_zeros(self.shape, k.dtype, k.device, self._maps))

    def drop_pages(self) -> None:
        """Hand every CPU buffer's resident pages back to the kernel: only when no slot holds
        KV (the cache flushed, nothing running). They read as zeros again and are backed anew
        at their next write, so the pool again holds what is served, not what a burst touched
        (after 64 x 256-token replies and a flush, the default model's runtime kept 700 MB)."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take over all layers, as stored (scales included)."""
        k = self.k_buffers[0]
        return 2 * self.num_layers * self.shape[1] * self.shape[2] * k.element_size()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V rows `[T, kv_heads, head_dim]` at `slots`, quantized once here (and
        rotated first, int8) when the pool is."""
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if self.rotation is not None:
            k, v = k @ self.rotation.to(k.dtype), v @ self.rotation.to(v.dtype)
        if self.fmt is KVFormat.INT8 and cpu_paged.supports_quantized(
            k_buf, self.head_dim, k.dtype
        ):
            cpu_paged.quantize_int8(k, slots, k_buf)  # one call, torch's bytes
            cpu_paged.quantize_int8(v, slots, v_buf)
            return
        if self.fmt:
            k, v = self.fmt.quantize(k), self.fmt.quantize(v)
        self.k_buffers[layer_id].index_copy_(0, slots, k)
        self.v_buffers[layer_id].index_copy_(0, slots, v)

    def attend(
        self, q: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """`attend(q)` over this pool's rows as stored: where they are rotated (an int8 pool,
        `kv_quant.rotation`, its own inverse) the queries are rotated the same way and the
        output, a sum of rotated values, back. Every attention backend goes through it."""
        if self.rotation is None:
            return attend(q)
        return attend(q @ self.rotation) @ self.rotation

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows gathered from a buffer `[..., kv_heads, width]` as the values they hold, in the
        model's dtype (the rows themselves when the pool is not quantized; times `rotation`
        when it is int8)."""
        return self.fmt.dequantize(rows, self.dtype) if self.fmt else rows


def bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    fmt: KVFormat | None = None,
) -> int:
    """Bytes one token's K and V take in a pool of `dtype`, or of the quantized `fmt`."""
    if fmt:
        return 2 * num_layers * num_kv_heads * fmt.row_width(head_dim)
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
