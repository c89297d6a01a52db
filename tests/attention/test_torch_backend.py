"""The torch attention backend on its own, without a model: mixed steps of decodes and extends
(batched into padded groups), globally and within sliding windows, against a plain float64
reference over the same paged pool."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.attention.torch_backend import PAD_SLACK, TorchAttentionBackend, group_extends
from radixrt.forward_batch import ForwardBatch
from radixrt.mem_cache.memory_pool import TokenToKVPool

HQ, HKV, D = 4, 2, 16
SLOTS, CONTEXT = 2048, 300


def _step(
    prefix_lens: list[int],
    extend_lens: list[int],
    seed: int,
    shared: int = 0,
    window: int | None = None,
    cap: float | None = None,
):
    """A pool with random K/V, each request's row pointing at scattered slots (the first `shared`
    the same for every request, as the tree gives them), and the new tokens' q/k/v; returns the
    backend (its one layer within `window`, its scores soft-capped at `cap`), the batch and the
    tensors."""
    gen = torch.Generator().manual_seed(seed)
    pool = TokenToKVPool(SLOTS, 1, HKV, D, torch.float32, torch.device("cpu"))
    pool.k_buffers[0].copy_(torch.randn(SLOTS, HKV, D, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(SLOTS, HKV, D, generator=gen))
    req_to_token = torch.zeros(len(prefix_lens) + 1, CONTEXT, dtype=torch.int32)
    free = torch.randperm(SLOTS - 1, generator=gen) + 1  # slot 0 is padding
    common, free = free[:shared], free[shared:]
    for b, seq in enumerate(p + e for p, e in zip(prefix_lens, extend_lens)):
        own = seq - shared
        req_to_token[b + 1, :seq] = torch.cat([common, free[:own]]).to(torch.int32)
        free = free[own:]
    rows = torch.arange(1, len(prefix_lens) + 1)
    out_slots = torch.cat(
        [req_to_token[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)]
    ).long()
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    batch = ForwardBatch(positions, positions, out_slots, rows, prefix_lens, extend_lens)
    t = len(out_slots)
    qkv = [torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV)]
    return TorchAttentionBackend(req_to_token, pool, (window,), cap), batch, qkv


def _reference(
    backend: TorchAttentionBackend,
    batch: ForwardBatch,
    q: torch.Tensor,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Each request's queries over its whole sequence in the pool (new K/V already written),
    causal from its prefix on, within `window` (transformers': keys above position - window),
    scores soft-capped at `cap` (Gemma 2's cap * tanh(s / cap)), in float64."""
    pool, outs, start = backend.kv_pool, [], 0
    for row, p, e in zip(batch.rows.tolist(), batch.prefix_lens, batch.extend_lens):
        slots = backend.req_to_token[row, : p + e].long()
        k = pool.k_buffers[0][slots].double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        v = pool.v_buffers[0][slots].double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        qi = q[start : start + e].double().transpose(0, 1)
        scores = qi @ k.transpose(1, 2) / D**0.5
        if cap:
            scores = cap * torch.tanh(scores / cap)
        at = (p + torch.arange(e))[:, None]
        hidden = torch.arange(p + e)[None, :] > at
        if window:
            hidden |= torch.arange(p + e)[None, :] <= at - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
        start += e
    return torch.cat(outs).float()


STEPS = {
    "decodes sharing a prefix": ([40, 52, 45, 40], [1, 1, 1, 1], 32),
    "short extends after prefixes": ([40, 41, 55, 60, 38], [3, 5, 2, 4, 6]),
    "prefill alone beside short extends": ([0, 30, 31, 29], [200, 4, 3, 5]),
    "extends and decodes": ([50, 0, 70, 71, 72, 12], [4, 17, 1, 1, 1, 9]),
    "one extend without a prefix": ([0], [33]),
    "one extend after a prefix": ([120], [7]),
}


@pytest.mark.parametrize("in_place", [True, False], ids=["decode-in-place", "decode-gathered"])
@pytest.mark.parametrize("name", STEPS)
def test_mixed_step_matches_the_reference(name, in_place):
    prefix_lens, extend_lens, *shared = STEPS[name]
    backend, batch, (q, k, v) = _step(prefix_lens, extend_lens, len(name), *shared)
    assert backend.in_place, "the in-place decode kernel did not build here"
    backend.in_place = in_place
    backend.init_forward_metadata(batch)
    # the cascade when requests share a prefix, or when one request's short extend attends as
    # decode rows in place (its rows share its whole prefix: a speculative verification's shape)
    cascade = bool(shared) or (in_place and name == "one extend after a prefix")
    assert (batch.attn_metadata[None].shared_slots is not None) == cascade
    backend.kv_pool.set_kv(0, batch.out_slots, k, v)  # the model stores; the backend attends
    out = backend.forward(0, q, k, v, batch)
    torch.testing.assert_close(out, _reference(backend, batch, q), atol=2e-5, rtol=2e-5)


# one key; shorter than most extends; 40 (the shared prefix's decodes still share a run of it);
# longer than every sequence (the plain causal result); none, with soft-capped scores
@pytest.mark.parametrize(
    "window, cap", [(1, None), (7, None), (40, None), (1000, None), (None, 1.5), (7, 1.5)]
)
@pytest.mark.parametrize("in_place", [True, False], ids=["decode-in-place", "decode-gathered"])
@pytest.mark.parametrize("name", STEPS)
def test_mixed_step_within_a_window_or_capped_matches_the_reference(name, in_place, window, cap):
    prefix_lens, extend_lens, *shared = STEPS[name]
    backend, batch, (q, k, v) = _step(
        prefix_lens, extend_lens, len(name), *shared, window=window, cap=cap
    )
    backend.in_place = in_place
    backend.init_forward_metadata(batch)
    backend.kv_pool.set_kv(0, batch.out_slots, k, v)
    out = backend.forward(0, q, k, v, batch)
    expected = _reference(backend, batch, q, window, cap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_windowed_layer_reads_only_its_window():
    """Each decode row's slots are its last W positions' (the C kernel reads just those); an
    extend's start at the first key its first query sees: W - 1 before its prefix's end."""
    backend, batch, _ = _step([50, 0, 70, 71, 72, 12], [4, 17, 1, 1, 1, 9], seed=3, window=8)
    backend.in_place = False
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata[8]
    assert meta.decode_lens.tolist() == [8, 8, 8]
    for slots, request in zip(meta.decode_slots, [2, 3, 4]):
        seq, row = batch.seq_lens[request], int(batch.rows[request])
        assert slots.tolist() == backend.req_to_token[row, seq - 8 : seq].tolist()
    # (50 + 4) alone: 7 prefix keys and 4 new; (0 + 17) with (12 + 9): 17 and 7 + 9
    assert sorted(group.slots.shape[1] for group in meta.extends) == [7 + 4, 17]


@pytest.mark.parametrize("in_place", [True, False], ids=["decode-in-place", "decode-gathered"])
def test_short_extends_share_one_call_and_a_long_prefill_runs_alone(in_place):
    """Gathered, short extends share one padded call; read in place, they are decode rows."""
    prefix_lens, extend_lens = STEPS["prefill alone beside short extends"]
    backend, batch, _ = _step(prefix_lens, extend_lens, seed=0)
    backend.in_place = in_place
    backend.init_forward_metadata(batch)
    shapes = sorted(group.shape for group in batch.attn_metadata[None].extends)
    assert shapes == ([(1, 200)] if in_place else [(1, 200), (3, 5)])
    assert len(batch.attn_metadata[None].decode_tokens) == (4 + 3 + 5 if in_place else 0)


@pytest.mark.parametrize("seed", range(20))
def test_groups_cover_every_extend_once_within_the_padding_bound(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    extend_lens = [rng.choice([1, 2, 3, 5, 8, 64, 500]) for _ in range(n)]
    seq_lens = [e + rng.randint(0, 600) for e in extend_lens]
    extending = [i for i, e in enumerate(extend_lens) if e > 1]
    groups = group_extends(extending, extend_lens, seq_lens)
    assert sorted(i for g in groups for i in g) == extending
    for g in groups:
        padded = len(g) * max(extend_lens[i] for i in g) * max(seq_lens[i] for i in g)
        assert len(g) == 1 or padded <= PAD_SLACK * sum(extend_lens[i] * seq_lens[i] for i in g)
