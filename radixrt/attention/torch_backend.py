"""Attention over the paged pool with torch SDPA: the CPU default and the reference path.

Decodes (one new token) are batched: their contexts are gathered into a padded
`[B, Hkv, L, D]` view with a length mask. Extends (several new tokens) run one request at a
time, each with a mask that sees its whole cached prefix and is causal over its new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.forward_batch import ForwardBatch
from radixrt.memory_pool import TokenToKVPool


@dataclass
class _ExtendItem:
    tokens: slice  # rows of q/o in the flattened batch
    slots: torch.Tensor  # [seq_len] KV slots of the whole sequence
    mask: torch.Tensor | None  # [extend, seq_len] bool, None when plain causal


@dataclass
class TorchMetadata:
    decode_tokens: torch.Tensor  # [Bd] rows of q/o that are decodes
    decode_slots: torch.Tensor  # [Bd, L] KV slots, padded with slot 0
    decode_mask: torch.Tensor  # [Bd, 1, 1, L] bool
    extends: list[_ExtendItem]


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
                mask = torch.ones(e, seq_lens[i], dtype=torch.bool, device=device).tril(diagonal=prefix)
            extends.append(_ExtendItem(slice(starts[i], starts[i + 1]), slots, mask))
        if decodes:
            lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
            max_len = int(lens.max())
            slots = self.req_to_token[batch.rows[decodes], :max_len].long()
            mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            slots = slots.masked_fill(~mask, 0)
            decode_tokens = torch.tensor([starts[i] for i in decodes], device=device)
            batch.attn_metadata = TorchMetadata(decode_tokens, slots, mask[:, None, None, :], extends)
        else:
            empty = torch.empty(0, dtype=torch.long, device=device)
            batch.attn_metadata = TorchMetadata(empty, empty, empty, extends)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_slots, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        meta: TorchMetadata = batch.attn_metadata
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for item in meta.extends:
            qi = q[item.tokens].transpose(0, 1)
            ki = k_buf[item.slots].transpose(0, 1)
            vi = v_buf[item.slots].transpose(0, 1)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=item.mask, is_causal=item.mask is None,
                                                enable_gqa=gqa)
            out[item.tokens] = oi.transpose(0, 1)
        if len(meta.decode_tokens):
            qd = q[meta.decode_tokens].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = k_buf[meta.decode_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = v_buf[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=gqa)
            out[meta.decode_tokens] = od.squeeze(2)
        return out
