"""Attention over the paged pool in torch: the CPU default and the reference path.

Decodes (one new token) are batched: their contexts are gathered into a padded
`[B, Hkv, L, D]` view with a length mask. When all decodes share a cached prefix (the slots
are the same: the radix tree gave them the same pages), that prefix is read once and attended
by every query in one call, and only the private suffixes are gathered per request; the two
halves are merged by their log-sum-exp (cascade attention). Extends (several new tokens: prefill
chunks, jump-forward appends, the suffix after a cache hit) are batched too: requests of similar
sizes are padded into one call per layer, each query seeing its cached prefix and, causally, the
new tokens before it; a group grows only while padding at most doubles its work, so a long prefill
runs alone rather than padding many short extends up to its size. Where decodes read K/V in place
(the C kernel), a short extend (a speculative draft being verified, a jump-forward append) is
attended as that many decode rows instead, each row's keys ending at its own position: reading a
long context in place a few times beats gathering it once into a padded copy.

A layer with a sliding window W reads only its window: its own metadata (one per distinct window
of the model's layers) gathers, for a query at position p, the keys from max(0, p - W + 1) on,
and masks the earlier ones an extend's later queries no longer see. With a logit cap (Gemma 2)
the scores are soft-capped before the softmax: in the C kernel, and by plain torch math where
SDPA would run (it cannot cap).

Under `--enable-deterministic-inference` (`deterministic`) every query row, a prompt's as a
decode's, is one decode row of the C kernel, read in place over exactly the keys it sees, in one
key range (no split by batch or thread count) and without the shared-prefix merge: a row's sum
runs over its keys in order in blocks of 32 whatever the batch, and a prompt token computed in a
prefill, a chunk, a verified draft or after a cache hit reduces as it would decoded. The cost:
an extend's rows each walk their keys (no SDPA over the chunk), and the step's slot table is
rows x longest context. The runner asks the same order of every step with prompt rows
(`rows_exact`) where its linears are grouped 4/8-bit on the CPU: their kernels compute each
row alone, so a prompt token's bits no longer depend on the rows beside it, and a cache hit or
a chunk cannot change a quantized model's answer (a split prefix changed 4 of 6 short chat
answers of the default model before). Steps of decodes alone keep their split (a long
context's keys across threads: 64 against 43 tok/s at 2k tokens), which follows the step's
rows, not the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_paged, native

if TYPE_CHECKING:  # types only: the pools' owners import this package, not the reverse
    from radixrt.mem_cache.memory_pool import TokenToKVPool


@dataclass
class _ExtendGroup:
    """Extends attended in one call: B requests, queries padded to E, contexts padded to L."""

    tokens: torch.Tensor  # [sum e] rows of q/o in the flattened batch
    padded: torch.Tensor  # [sum e] the same queries' rows in the padded [B * E] layout
    slots: torch.Tensor  # [B, L] KV slots of each whole sequence, padded with slot 0
    # [B, 1, E, L] additive: 0 where a query sees a key, -inf elsewhere; None when plainly causal
    mask: torch.Tensor | None
    shape: tuple[int, int]  # (B, E)


@dataclass
class TorchMetadata:
    decode_tokens: torch.Tensor  # [Bd] rows of q/o attended as decodes
    # KV slots all decodes start with; a slice if contiguous, None if few
    shared_slots: torch.Tensor | slice | None
    decode_slots: torch.Tensor  # [Bd, L] the rest of each decode's context, padded with slot 0
    decode_lens: torch.Tensor  # [Bd] how many of decode_slots are real
    decode_bias: torch.Tensor  # [Bd, 1, 1, L] 0 where decode_slots is real, -inf on the padding
    extends: list[_ExtendGroup]
    fixed_order: bool = False  # every decode row's keys in one range, one order (no split)


MIN_SHARED_PREFIX = 16  # below this, reading the prefix once does not pay for the merge
PAD_SLACK = 2.0  # an extend group's padded work (B * E * L) may be at most this times its real work
MAX_DECODE_ROWS = 16  # extends up to this long attend as decode rows when decodes read in place


class TorchAttentionBackend:
    """`windows`: each layer's sliding window (None: global; empty: every layer global);
    `logit_cap`: scores become cap * tanh(scores / cap) before the softmax (None: unchanged).
    `batch.attn_metadata` maps each window to its `TorchMetadata`."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        kv_pool: TokenToKVPool,
        windows: tuple[int | None, ...] = (),
        logit_cap: float | None = None,
        deterministic: bool = False,
        rows_exact: bool = False,
    ):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.windows = windows or (None,) * len(kv_pool.k_buffers)
        self.logit_cap = logit_cap
        if kv_pool.k_buffers[0].device.type == "cpu":
            native.find_compiler()  # warns now, at start, when the C kernels cannot be built
        # decodes read K/V in the pool rather than gathering them (cpu_paged; float32 CPU, or
        # a quantized pool's rows, dequantized as they are read)
        self.in_place = (
            cpu_paged.supports_quantized(kv_pool.k_buffers[0], kv_pool.head_dim, kv_pool.dtype)
            if kv_pool.fmt
            else cpu_paged.supports(kv_pool.k_buffers[0])
        )
        self.deterministic = deterministic
        # `rows_exact`: a step with prompt rows in the deterministic mode's order where the
        # in-place kernel runs, never refused (the runner asks it of grouped linears, whose
        # rows are already independent); a step of decodes alone keeps its split
        self.rows_exact = rows_exact and self.in_place
        if deterministic and not self.in_place:
            raise ValueError(
                "--enable-deterministic-inference attends with the in-place C kernel: a float32 "
                "KV pool on the CPU, a head size up to 256 and a C compiler"
            )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = {w: self._metadata(batch, w) for w in set(self.windows)}

    def _metadata(self, batch: ForwardBatch, window: int | None) -> TorchMetadata:
        """The step's layout for layers with this sliding window (None: global)."""
        device = self.req_to_token.device
        seq_lens = batch.seq_lens
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        as_rows = MAX_DECODE_ROWS if self.in_place else 1
        prompt_rows = any(e > 1 for e in batch.extend_lens)
        fixed = self.deterministic or (self.rows_exact and prompt_rows)
        if fixed:  # every row a decode row, however long its extend
            as_rows = max(batch.extend_lens, default=1)
        decodes = [i for i, e in enumerate(batch.extend_lens) if e <= as_rows]
        extending = [i for i, e in enumerate(batch.extend_lens) if e > as_rows]
        extends = [
            self._extend_group(batch, starts, group, window)
            for group in group_extends(extending, batch.extend_lens, seq_lens)
        ]
        empty = torch.empty(0, dtype=torch.long, device=device)
        if not decodes:
            return TorchMetadata(empty, None, empty, empty, empty, extends, fixed)
        # one decode row per new token: its row of q, its request's table row, the keys it sees
        queries = [
            (starts[i] + j, i, batch.prefix_lens[i] + j + 1)
            for i in decodes
            for j in range(batch.extend_lens[i])
        ]
        lens = torch.tensor([seen for _, _, seen in queries], device=device)
        first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
        lens = lens - first
        max_len = int(lens.max())
        slots = self._slots(batch.rows[[i for _, i, _ in queries]], first, max_len)
        mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
        shared = _shared_prefix_len(slots, mask) if len(queries) > 1 else 0
        if shared < MIN_SHARED_PREFIX or fixed:
            shared = 0
        decode_tokens = torch.tensor([row for row, _, _ in queries], device=device)
        shared_slots = _as_run(slots[0, :shared]) if shared else None
        slots, mask = slots[:, shared:], mask[:, shared:]
        bias = torch.zeros(mask.shape, dtype=self.kv_pool.dtype, device=device)
        bias.masked_fill_(~mask, float("-inf"))
        return TorchMetadata(
            decode_tokens,
            shared_slots,
            slots.masked_fill(~mask, 0),
            lens - shared,
            bias[:, None, None, :],
            extends,
            fixed,
        )

    def _slots(self, rows: torch.Tensor, first: torch.Tensor, length: int) -> torch.Tensor:
        """[len(rows), length] pool slots of each row's positions from `first` on (columns past
        the table's end repeat its last; the caller masks what lies past each sequence)."""
        cols = first[:, None] + torch.arange(length, device=first.device)[None, :]
        cols = cols.clamp(max=self.req_to_token.shape[1] - 1)
        return self.req_to_token[rows[:, None], cols].long()

    def _extend_group(
        self, batch: ForwardBatch, starts: list[int], group: list[int], window: int | None
    ) -> _ExtendGroup:
        """The padded layout of one group: its queries' rows, each sequence's slots from the
        first its first query sees (slot 0 past its end) and, unless a lone request without a
        prefix sees all its keys (and SDPA's own causal mask serves), the additive mask: the
        prefix, causal, within the window."""
        device = self.req_to_token.device
        extend = torch.tensor([batch.extend_lens[i] for i in group], device=device)
        prefix = torch.tensor([batch.prefix_lens[i] for i in group], device=device)
        first = (prefix + 1 - window).clamp(min=0) if window else torch.zeros_like(prefix)
        width, length = int(extend.max()), int((prefix + extend - first).max())
        slots = self._slots(batch.rows[group], first, length)
        keys = first[:, None] + torch.arange(length, device=device)[None, :]  # [B, L] positions
        slots.masked_fill_(keys >= (prefix + extend)[:, None], 0)
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in group])
        padded = torch.cat(
            [
                b * width + torch.arange(batch.extend_lens[i], device=device)
                for b, i in enumerate(group)
            ]
        )
        mask = None
        windowed = window is not None and window < width
        if len(group) > 1 or int(prefix[0]) or windowed or self.logit_cap is not None:
            # a padded query repeats its request's last one, so no row is fully masked
            query = torch.minimum(torch.arange(width, device=device)[None, :], extend[:, None] - 1)
            at = (prefix[:, None] + query)[:, :, None]  # [B, E, 1] each query's position
            seen = keys[:, None, :] <= at
            if window:
                seen &= keys[:, None, :] > at - window
            mask = torch.zeros(seen.shape, dtype=self.kv_pool.dtype, device=device)
            mask = mask.masked_fill_(~seen, float("-inf"))[:, None]
        return _ExtendGroup(tokens, padded, slots, mask, (len(group), width))

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Attention of q over the pool, in the basis its rows are stored in (`attend`)."""
        return self.kv_pool.attend(q, lambda q: self._forward(layer_id, q, batch))

    def _forward(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        meta: TorchMetadata = batch.attn_metadata[self.windows[layer_id]]
        if not meta.extends:  # decodes only: every row of q is one
            return self._decode(q, k_buf, v_buf, meta)
        out = torch.empty_like(q)
        for group in meta.extends:
            out[group.tokens] = self._extend(q, k_buf, v_buf, group)
        if len(meta.decode_tokens):
            out[meta.decode_tokens] = self._decode(q[meta.decode_tokens], k_buf, v_buf, meta)
        return out

    def _extend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: _ExtendGroup
    ) -> torch.Tensor:
        """The group's queries [sum e, Hq, D] -> their outputs, in one padded call."""
        b, width = group.shape
        qp = q.new_zeros((b * width, *q.shape[1:])).index_copy_(0, group.padded, q[group.tokens])
        qp = qp.view(b, width, *q.shape[1:]).transpose(1, 2)  # [B, Hq, E, D]
        kp = self.kv_pool.read(gather_slots(k_buf, group.slots)).transpose(1, 2)  # [B, Hkv, L, D]
        vp = self.kv_pool.read(gather_slots(v_buf, group.slots)).transpose(1, 2)
        o = _sdpa(qp, kp, vp, group.mask, self.logit_cap)
        return o.transpose(1, 2).reshape(b * width, *q.shape[1:]).index_select(0, group.padded)

    def _decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: TorchMetadata
    ) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] over the shared prefix and each private suffix."""
        b, hq, d = q.shape
        hkv = k_buf.shape[1]
        if self.in_place and hq // hkv <= cpu_paged.MAX_GROUP:
            o2, lse2 = self._paged_decode(q, k_buf, v_buf, meta)
            if meta.shared_slots is None:
                return o2
            o2, lse2 = o2.view(b, hkv, hq // hkv, d), lse2.view(b, hkv, hq // hkv)
            return _merge(*self._attend_prefix(q, k_buf, v_buf, meta.shared_slots), o2, lse2)
        kd = self.kv_pool.read(gather_slots(k_buf, meta.decode_slots))  # [B, L, Hkv, D]
        vd = self.kv_pool.read(gather_slots(v_buf, meta.decode_slots))
        if meta.shared_slots is None:
            od = _sdpa(
                q.unsqueeze(2),
                kd.transpose(1, 2),
                vd.transpose(1, 2),
                meta.decode_bias,
                self.logit_cap,
            )
            return od.squeeze(2)
        qg = q.view(b, hkv, hq // hkv, d)
        # private suffixes, padded
        o2, lse2 = _attend(
            qg, kd.transpose(1, 2), vd.transpose(1, 2), meta.decode_bias, self.logit_cap
        )
        return _merge(*self._attend_prefix(q, k_buf, v_buf, meta.shared_slots), o2, lse2)

    def _paged_decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: TorchMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The C kernel over each decode's private keys, in place: float rows, or a quantized
        pool's rows dequantized as read."""
        fmt = self.kv_pool.fmt
        out: tuple[torch.Tensor, torch.Tensor] = cpu_paged.paged_decode(
            q,
            k_buf,
            v_buf,
            meta.decode_slots,
            meta.decode_lens,
            self.logit_cap,
            splits=1 if meta.fixed_order else None,  # one key range: one order
            kind=fmt.kernel_kind if fmt else None,
        )
        return out

    def _attend_prefix(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        shared: torch.Tensor | slice,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query [B, Hq, D] against the shared prefix, read once, in one call per KV head:
        out [B, Hkv, G, D] and log-sum-exp [B, Hkv, G]."""
        b, hq, d = q.shape
        hkv = k_buf.shape[1]
        qg = q.view(b, hkv, hq // hkv, d).transpose(0, 1).reshape(1, hkv, -1, d)
        ks = self.kv_pool.read(gather_slots(k_buf, shared)).transpose(0, 1)[None]  # [1, Hkv, C, D]
        vs = self.kv_pool.read(gather_slots(v_buf, shared)).transpose(0, 1)[None]
        o1, lse1 = _attend(qg, ks, vs, cap=self.logit_cap)
        return o1.view(hkv, b, -1, d).transpose(0, 1), lse1.view(hkv, b, -1).transpose(0, 1)


def _merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Two halves of one softmax, [B, Hkv, G, D] with their log-sum-exps -> the whole, [B, Hq, D]."""
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # softmax weight of the prefix half
    b, hkv, g, d = o1.shape
    return (o1 * w1 + o2 * (1 - w1)).reshape(b, hkv * g, d)


def group_extends(
    extending: list[int], extend_lens: list[int], seq_lens: list[int]
) -> list[list[int]]:
    """The extending requests in groups for one padded call each: by context length, a group
    grows while its padded work (B * E * L) stays within PAD_SLACK times its real work."""
    groups: list[list[int]] = []
    for i in sorted(extending, key=lambda i: (seq_lens[i], extend_lens[i])):
        group = groups[-1] + [i] if groups else []
        padded = len(group) * max((extend_lens[j] for j in group), default=0) * seq_lens[i]
        real = sum(extend_lens[j] * seq_lens[j] for j in group)
        if group and padded <= PAD_SLACK * real:
            groups[-1] = group
        else:
            groups.append([i])
    return groups


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


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    cap: float | None,
) -> torch.Tensor:
    """SDPA of q [B, Hq, Lq, D] over k/v [B, Hkv, L, D] (GQA), causal where `bias` is None; with
    `cap` (given a bias) the soft-capped scores, which SDPA cannot, by `_attend` over k/v
    repeated per query head."""
    if cap is None:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=bias is None, enable_gqa=gqa
        )
    group = q.shape[1] // k.shape[1]
    return _attend(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), bias, cap)[0]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s + bias) v, [B, H, Lq, D], and the log-sum-exp of those scores, [B, H, Lq], where
    s = q k^T / sqrt(D), soft-capped to cap * tanh(s / cap) with `cap`.

    On the CPU, ATen's fused flash kernel returns both (2x faster than the unfused ops here); it
    cannot cap.
    """
    if q.device.type == "cpu" and cap is None:
        # torch.ops resolves its operators at run time: mypy sees Any
        out: tuple[torch.Tensor, torch.Tensor] = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
        )
        return out
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def _shared_prefix_len(slots: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading slots every row has in common (and really holds)."""
    same = (slots == slots[:1]) & mask
    return int(same.int().cumprod(dim=1).sum(dim=1).min())
