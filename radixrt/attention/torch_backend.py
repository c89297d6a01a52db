"""Attention over the paged pool in torch: the CPU default and the reference path.

Decodes (one new token) are batched: their contexts are gathered into a padded
`[B, Hkv, L, D]` view with a length mask. When all decodes share a cached prefix (the slots
are the same: the radix tree gave them the same pages), that prefix is read once and attended
by every query in one call, and only the private suffixes are gathered per request; the two
halves are merged by their log-sum-exp (cascade attention). Extends (several new tokens) run one
request at a time, each with a mask that sees its whole cached prefix and is causal over its
new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # types only: the executor and the pools import this package, not the reverse
    from radixrt.executor.forward_batch import ForwardBatch
    from radixrt.mem_cache.memory_pool import TokenToKVPool


@dataclass
class _ExtendItem:
    tokens: slice  # rows of q/o in the flattened batch
    slots: torch.Tensor  # [seq_len] KV slots of the whole sequence
    mask: torch.Tensor | None  # [extend, seq_len] bool, None when plain causal


@dataclass
class TorchMetadata:
    decode_tokens: torch.Tensor  # [Bd] rows of q/o that are decodes
    # KV slots all decodes start with; a slice if contiguous, None if few
    shared_slots: torch.Tensor | slice | None
    decode_slots: torch.Tensor  # [Bd, L] the rest of each decode's context, padded with slot 0
    decode_bias: torch.Tensor  # [Bd, 1, 1, L] 0 where decode_slots is real, -inf on the padding
    extends: list[_ExtendItem]


MIN_SHARED_PREFIX = 16  # below this, reading the prefix once does not pay for the merge


class TorchAttentionBackend:
    def __init__(self, req_to_token: torch.Tensor, kv_pool: TokenToKVPool):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.device
        seq_lens = batch.seq_lens
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        decodes = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        extends = []
        for i, e in enumerate(batch.extend_lens):
            if e == 1:
                continue
            slots = self.req_to_token[batch.rows[i], : seq_lens[i]].long()
            prefix = batch.prefix_lens[i]
            mask = None
            if prefix:
                mask = torch.ones(e, seq_lens[i], dtype=torch.bool, device=device).tril(
                    diagonal=prefix
                )
            extends.append(_ExtendItem(slice(starts[i], starts[i + 1]), slots, mask))
        empty = torch.empty(0, dtype=torch.long, device=device)
        if not decodes:
            batch.attn_metadata = TorchMetadata(empty, None, empty, empty, extends)
            return
        lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
        max_len = int(lens.max())
        slots = self.req_to_token[batch.rows[decodes], :max_len].long()
        mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
        shared = _shared_prefix_len(slots, mask) if len(decodes) > 1 else 0
        if shared < MIN_SHARED_PREFIX:
            shared = 0
        decode_tokens = torch.tensor([starts[i] for i in decodes], device=device)
        shared_slots = _as_run(slots[0, :shared]) if shared else None
        slots, mask = slots[:, shared:], mask[:, shared:]
        bias = torch.zeros(mask.shape, dtype=self.kv_pool.k_buffers[0].dtype, device=device)
        bias.masked_fill_(~mask, float("-inf"))
        batch.attn_metadata = TorchMetadata(
            decode_tokens,
            shared_slots,
            slots.masked_fill(~mask, 0),
            bias[:, None, None, :],
            extends,
        )

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_slots, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        meta: TorchMetadata = batch.attn_metadata
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for item in meta.extends:
            qi = q[item.tokens].transpose(0, 1)
            ki = gather_slots(k_buf, item.slots).transpose(0, 1)
            vi = gather_slots(v_buf, item.slots).transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=item.mask, is_causal=item.mask is None, enable_gqa=gqa
            )
            out[item.tokens] = oi.transpose(0, 1)
        if len(meta.decode_tokens):
            out[meta.decode_tokens] = self._decode(q[meta.decode_tokens], k_buf, v_buf, meta)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: TorchMetadata
    ) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] over the shared prefix and each private suffix."""
        kd = gather_slots(k_buf, meta.decode_slots)  # [B, L, Hkv, D]
        vd = gather_slots(v_buf, meta.decode_slots)
        if meta.shared_slots is None:
            od = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                kd.transpose(1, 2),
                vd.transpose(1, 2),
                attn_mask=meta.decode_bias,
                enable_gqa=q.shape[1] != kd.shape[2],
            )
            return od.squeeze(2)
        b, hq, d = q.shape
        hkv = kd.shape[2]
        qg = q.view(b, hkv, hq // hkv, d)
        # shared prefix: every query of a KV head against the prefix in one call
        ks = gather_slots(k_buf, meta.shared_slots).transpose(0, 1)[None]  # [1, Hkv, C, D]
        vs = gather_slots(v_buf, meta.shared_slots).transpose(0, 1)[None]
        o1, lse1 = _attend(qg.transpose(0, 1).reshape(1, hkv, -1, d), ks, vs)
        o1 = o1.view(hkv, b, -1, d).transpose(0, 1)
        lse1 = lse1.view(hkv, b, -1).transpose(0, 1)
        # private suffixes, padded
        o2, lse2 = _attend(qg, kd.transpose(1, 2), vd.transpose(1, 2), meta.decode_bias)
        w1 = torch.sigmoid(lse1 - lse2)[..., None]  # softmax weight of the prefix half
        return (o1 * w1 + o2 * (1 - w1)).reshape(b, hq, d)


def gather_slots(buf: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """`buf[slots]` for a pool buffer `[slots, H, D]`: a view for a contiguous run, else index_select,
    which copies whole rows 2-4x faster than advanced indexing on the CPU."""
    if isinstance(slots, slice):
        return buf[slots]
    return buf.index_select(0, slots.flatten()).view(*slots.shape, *buf.shape[1:])


def _as_run(slots: torch.Tensor) -> torch.Tensor | slice:
    """`slots` as a slice when they are consecutive (a prefix written by one prefill usually is)."""
    if bool((slots.diff() == 1).all()):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return slots


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(D) + bias) v, [B, H, Lq, D], and the log-sum-exp of those scores, [B, H, Lq].

    On the CPU, ATen's fused flash kernel returns both (2x faster than the unfused ops here).
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def _shared_prefix_len(slots: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading slots every row has in common (and really holds)."""
    same = (slots == slots[:1]) & mask
    return int(same.int().cumprod(dim=1).sum(dim=1).min())
