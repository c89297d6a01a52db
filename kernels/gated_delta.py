"""The gated delta rule of Gated DeltaNet (Qwen3.5, Qwen3-Next) on the GPU, over the per-slot
recurrent states in place: one launch for a whole batch, decode rows and prefill runs alike.

Per token and value head, with decay exp(g) and write strength beta, the state S [Dk, Dv] is
decayed, corrected towards v along k (S += k (beta (v - S^T k))^T) and read by q (o = S^T q),
as `GatedDeltaNet._step` does on the CPU. Each program holds one (request, value head, Dv tile)
of the state in registers, in float32: the columns of S are independent of one another (each
update reads S^T k and S^T q column by column), so the tiles split the work with no exchange.
It reads the tile from the request's slot (zeros for a request starting at position 0), runs
the request's tokens through it one after another, and writes it back to the slot in the
buffer's dtype. The state is read and written once per launch whatever the run's length.

A decode step is B runs of one token, row b request b's. A prefill run goes through its tokens
one after another: it is the recurrence itself, not the chunked (WY) matrix form of
`delta_chunk`, so a long prompt costs one dependent step per token, where the chunked form
would multiply matrices; what it gains is the recurrence's own rounding, and one kernel for
decode rows and prefill runs in the same batch.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from .jit import jit


@jit
def run_of(
    runs: tl.tensor, num_runs: tl.tensor, r: tl.tensor, ONE_TOKEN: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Run r of a `run_table`: its first row, its length and whether it starts fresh (its
    slot then unread). The kernels that carry a state per request (this one, `ssd`'s,
    `causal_conv`'s) start with it."""
    if ONE_TOKEN:
        first = r.to(tl.int64)
        n = 1
    else:
        first = tl.load(runs + num_runs + r)
        n = tl.load(runs + 2 * num_runs + r)
    return first, n, tl.load(runs + r) != 0


@jit
def _gated_delta_kernel(
    Q: tl.tensor,
    K: tl.tensor,
    V: tl.tensor,
    G: tl.tensor,
    Beta: tl.tensor,
    O: tl.tensor,
    State: tl.tensor,
    slots: tl.tensor,
    runs: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_slot: tl.tensor,
    num_runs: tl.tensor,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
) -> None:
    """Run program_id(0)'s tokens through value head program_id(1)'s state, columns
    program_id(2) * BLOCK_V onwards. `runs`, int64 rows of num_runs: whether each run starts
    fresh, then (unless ONE_TOKEN: run r is row r alone) each one's first row and its length.
    G and Beta are [T, H] contiguous; the state buffer [slots, H, DK, DV] contiguous past the
    slot, its slot ids int64 so their offsets cannot overflow."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_in = ks < DK
    v_in = vs < DV
    first, n, fresh = run_of(runs, num_runs, r, ONE_TOKEN)
    tile = State + tl.load(slots + r) * stride_slot + h * DK * DV + ks[:, None] * DV + vs[None, :]
    in_tile = k_in[:, None] & v_in[None, :]
    stored = tl.where(fresh, 0, DK)  # the slot's rows to read: none if fresh
    s = tl.load(tile, mask=(ks[:, None] < stored) & v_in[None, :], other=0.0).to(tl.float32)
    for t in range(0, n):
        row = first + t
        q = tl.load(Q + row * stride_qt + h * stride_qh + ks, mask=k_in, other=0.0).to(tl.float32)
        k = tl.load(K + row * stride_kt + h * stride_kh + ks, mask=k_in, other=0.0).to(tl.float32)
        v = tl.load(V + row * stride_vt + h * stride_vh + vs, mask=v_in, other=0.0).to(tl.float32)
        g = tl.load(G + row * H + h).to(tl.float32)
        beta = tl.load(Beta + row * H + h).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # beta (v - S^T k)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(O + row * stride_ot + h * stride_oh + vs, o.to(O.dtype.element_ty), mask=v_in)
    tl.store(tile, s.to(State.dtype.element_ty), mask=in_tile)


def run_table(
    prefix_lens: list[int], extend_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, bool]:
    """The `runs` table of a kernel that carries one recurrent state per request through its
    tokens (this one, `ssd`'s), and whether every run is a single token (`ONE_TOKEN`). Int64 on
    `device`, a row of B per field: whether each request starts fresh (`prefix_lens[b] == 0`, so
    its slot is not read), then, unless ONE_TOKEN (run b is then row b alone, and the kernel is
    compiled without the lookups), its first row (the requests' tokens back to back) and its
    length."""
    one_token = all(n == 1 for n in extend_lens)
    fresh = [int(p == 0) for p in prefix_lens]
    table = [fresh] if one_token else [fresh, [0, *accumulate(extend_lens)][:-1], extend_lens]
    return torch.tensor(table, dtype=torch.int64, device=device), one_token


BLOCK_V = 32  # state columns per program: a [128, 32] float32 tile is 32 registers a thread


def gated_delta_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
) -> None:
    """The gated delta rule over B requests' new tokens, back to back (request b's
    `extend_lens[b]` rows after the earlier requests'), in one launch; the output written into
    `out` [T, H, Dv].

    q and k [T, H, Dk] (already one per value head, L2-normed, q scaled), v [T, H, Dv], each
    with a contiguous last dim; g (the log decay, < 0) and beta [T, H] contiguous; any float
    dtype, computed in float32. `state` [slots, H, Dk, Dv] (float32, bfloat16 or float16,
    contiguous past the slot dim) holds request b's state at slot `slots[b]` (int64 [B], on the
    device, distinct): read from there, or zeros where `prefix_lens[b] == 0`, and the state after
    its last token written back in place, rounded to the buffer's dtype; no other slot is
    touched. Sequential over each request's tokens, so its output rounds as
    `GatedDeltaNet._step` run token by token."""
    tokens, heads, dk = k.shape
    dv = v.shape[-1]
    assert q.shape == k.shape and v.shape[:2] == (tokens, heads) and out.shape == v.shape
    assert all(x.stride(-1) == 1 for x in (q, k, v, out)), "gated_delta needs contiguous heads"
    assert g.shape == beta.shape == (tokens, heads) and g.is_contiguous() and beta.is_contiguous()
    assert state.shape[1:] == (heads, dk, dv) and state.stride()[1:] == (dk * dv, dv, 1)
    assert len(prefix_lens) == len(extend_lens) == slots.numel() and sum(extend_lens) == tokens
    assert slots.dtype == torch.int64
    if not extend_lens:
        return
    runs, one_token = run_table(prefix_lens, extend_lens, q.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (len(extend_lens), heads, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        state,
        slots,
        runs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        len(extend_lens),
        H=heads,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        ONE_TOKEN=one_token,
    )
