"""Attention over the paged pool with the Triton kernels: the CUDA default.

A step of decodes only (one new token each) runs the split-KV decode kernel over each request's
whole context. Any other step, prefills and decodes mixed, runs the extend kernel once for the
whole batch: a decode is just an extend of one token. One layout serves every layer: a layer with
a sliding window passes it to the kernels, which read only the keys within it.

Under `--enable-deterministic-inference` (`deterministic`) every step runs the decode kernel,
one row per new token over exactly the keys it sees, with `FIXED_KV_SPLITS` splits whatever the
batch: a row's split boundaries, each split's blocks and the merge then depend on its context
length alone, so a prompt token reduces as it would decoded, cached prefix or not.

A quantized pool (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`) is read in place by both kernels,
its rows dequantized as each tile is loaded (`kv_kind`); the pool's `set_kv` wrote them. The
extend kernel takes a step's new tokens as floats apart from the pool: with a quantized pool
always their rows read back and dequantized, so a prompt's tokens attend to each other with the
values every later step reads (as the torch backend does), whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import decode_attention_fwd, extend_attention_fwd

if TYPE_CHECKING:  # types only: the pools' owners import this package, not the reverse
    from radixrt.mem_cache.memory_pool import TokenToKVPool


MAX_KV_SPLITS = 8
MIN_SPLIT_LEN = 64  # one decode-kernel KV block; shorter splits only add merge work
FIXED_KV_SPLITS = 4  # the deterministic mode's splits per row, whatever the batch


@dataclass
class TritonMetadata:
    decode: bool  # every request has exactly one new token
    # [B+1] int32, new tokens of request b at rows qo_indptr[b]:qo_indptr[b+1]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor  # [B+1] int32, into kv_indices
    # pool slots: the whole context when decode, else only the cached prefix
    kv_indices: torch.Tensor
    max_extend_len: int
    num_kv_splits: int


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


class TritonAttentionBackend:
    """`windows`: each layer's sliding window (None: global; empty: every layer global);
    `logit_cap`: scores become cap * tanh(scores / cap) before the softmax (None: unchanged)."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        kv_pool: TokenToKVPool,
        windows: tuple[int | None, ...] = (),
        logit_cap: float | None = None,
        deterministic: bool = False,
    ):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.windows = windows or (None,) * len(kv_pool.k_buffers)
        self.logit_cap = logit_cap or 0.0
        self.deterministic = deterministic
        self.kv_kind = kv_pool.fmt.kernel_kind if kv_pool.fmt else None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.device
        if self.deterministic:
            batch.attn_metadata = self._rows_metadata(batch)
            return
        decode = all(e == 1 for e in batch.extend_lens)
        # The decode kernel reads the current token from the pool; the extend kernel reads new tokens from k/v.
        kv_lens = batch.seq_lens if decode else batch.prefix_lens
        max_kv_len = max(kv_lens)
        table = self.req_to_token[batch.rows, :max_kv_len]
        mask = (
            torch.arange(max_kv_len, device=device)[None, :]
            < torch.tensor(kv_lens, device=device)[:, None]
        )
        num_kv_splits = max(1, min(MAX_KV_SPLITS, max_kv_len // MIN_SPLIT_LEN))
        batch.attn_metadata = TritonMetadata(
            decode=decode,
            qo_indptr=_indptr(batch.extend_lens, device),
            kv_indptr=_indptr(kv_lens, device),
            kv_indices=table[mask],
            max_extend_len=max(batch.extend_lens),
            num_kv_splits=num_kv_splits,
        )

    def _rows_metadata(self, batch: ForwardBatch) -> TritonMetadata:
        """Every new token a decode row over its own keys (its request's table up to its
        position), `FIXED_KV_SPLITS` splits each: the deterministic mode's layout."""
        device = self.req_to_token.device
        lens = [p + j + 1 for p, e in zip(batch.prefix_lens, batch.extend_lens) for j in range(e)]
        owner = torch.repeat_interleave(
            torch.arange(len(batch.extend_lens), device=device),
            torch.tensor(batch.extend_lens, device=device),
        )
        kv_indptr = _indptr(lens, device)
        lens_t = torch.tensor(lens, device=device)
        starts = torch.repeat_interleave(kv_indptr[:-1].long(), lens_t)
        pos = torch.arange(int(kv_indptr[-1]), device=device) - starts
        rows = torch.repeat_interleave(batch.rows[owner], lens_t)
        return TritonMetadata(
            decode=True,
            qo_indptr=_indptr([1] * len(lens), device),
            kv_indptr=kv_indptr,
            kv_indices=self.req_to_token[rows, pos],
            max_extend_len=1,
            num_kv_splits=FIXED_KV_SPLITS,
        )

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Attention of q over the pool, in the basis its rows are stored in (`attend`; a
        quantized pool's new rows are read back from it, so k and v serve float pools only)."""
        return self.kv_pool.attend(q, lambda q: self._forward(layer_id, q, k, v, batch))

    def _forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        meta: TritonMetadata = batch.attn_metadata
        window = self.windows[layer_id]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode:
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                meta.kv_indptr,
                meta.kv_indices,
                meta.num_kv_splits,
                logit_cap=self.logit_cap,
                sliding_window=window,
                kv_kind=self.kv_kind,
            )
        else:
            if k is None or self.kv_kind is not None:  # the values the pool holds
                k = self.kv_pool.read(k_buf[batch.out_slots])
                v = self.kv_pool.read(v_buf[batch.out_slots])
            extend_attention_fwd(
                q,
                k,
                v,
                out,
                k_buf,
                v_buf,
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.max_extend_len,
                logit_cap=self.logit_cap,
                sliding_window=window,
                kv_kind=self.kv_kind,
            )
        return out
