"""Mamba-2's selective state-space recurrence on the GPU, over the per-slot states in place: one
launch for a whole batch, decode rows and prefill runs alike.

Per token and head, with time step dt and a = -exp(A_log) < 0, the state S [P, N] decays by
exp(dt a) and gains dt x B^T, then is read by C (y = S C; the D x skip and the gated norm stay
with the caller), as `Mamba2Mixer._step` does on the CPU. Row p of S depends only on x[p] and
the token's B and C, so a program holds one (request, head, tile of P rows) of the state in
registers, in float32, with all N columns (y sums over them), and the tiles need nothing from
one another. It reads the tile from the request's slot (zeros for a request starting at position
0), runs the request's tokens through it one after another, and writes it back to the slot in
the buffer's dtype: one read and one write of the state per launch, however long the run.

A decode step is B runs of one token, row b request b's. A prefill run is stepped token by
token, not put through the state space dual form of `ssd_chunk` (matrix products over a chunk):
a long prompt pays one dependent step a token, and in return keeps the recurrence's own rounding
and shares one kernel with the decode rows in a mixed batch. The run table is the one
`gated_delta` builds (`run_table`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_delta import run_of, run_table
from .jit import jit


@jit
def _ssd_kernel(
    X: tl.tensor,
    DT: tl.tensor,
    A: tl.tensor,
    B: tl.tensor,
    C: tl.tensor,
    Y: tl.tensor,
    State: tl.tensor,
    slots: tl.tensor,
    runs: tl.tensor,
    stride_xt: tl.tensor,
    stride_xh: tl.tensor,
    stride_bt: tl.tensor,
    stride_bh: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    stride_yt: tl.tensor,
    stride_yh: tl.tensor,
    stride_slot: tl.tensor,
    num_runs: tl.tensor,
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
) -> None:
    """Run program_id(0)'s tokens through head program_id(1)'s state, rows program_id(2) *
    BLOCK_P onwards. `runs` as `run_table` lays it out (num_runs to a row). DT is [T, H]
    contiguous, A [H]; the state buffer [slots, H, P, N] contiguous past the slot, its slot ids
    int64 so their offsets cannot overflow."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    p_in = ps < P
    n_in = ns < N
    first, n, fresh = run_of(runs, num_runs, r, ONE_TOKEN)
    tile = State + tl.load(slots + r) * stride_slot + h * P * N + ps[:, None] * N + ns[None, :]
    in_tile = p_in[:, None] & n_in[None, :]
    stored = tl.where(fresh, 0, P)  # the slot's rows to read: none if fresh
    s = tl.load(tile, mask=(ps[:, None] < stored) & n_in[None, :], other=0.0).to(tl.float32)
    a = tl.load(A + h).to(tl.float32)
    for t in range(0, n):
        row = first + t
        x = tl.load(X + row * stride_xt + h * stride_xh + ps, mask=p_in, other=0.0).to(tl.float32)
        b = tl.load(B + row * stride_bt + h * stride_bh + ns, mask=n_in, other=0.0).to(tl.float32)
        c = tl.load(C + row * stride_ct + h * stride_ch + ns, mask=n_in, other=0.0).to(tl.float32)
        dt = tl.load(DT + row * H + h).to(tl.float32)
        s = s * tl.exp(dt * a) + (dt * b)[None, :] * x[:, None]  # the products as `_step` rounds
        y = tl.sum(s * c[None, :], axis=1)
        tl.store(Y + row * stride_yt + h * stride_yh + ps, y.to(Y.dtype.element_ty), mask=p_in)
    tl.store(tile, s.to(State.dtype.element_ty), mask=in_tile)


TILE = 4096  # state elements per program: 32 float32 registers a thread over 4 warps


def ssd_fwd(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    out: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
) -> None:
    """Mamba-2's recurrence over B requests' new tokens, back to back (request b's
    `extend_lens[b]` rows after the earlier requests'), in one launch; S C per token, without
    D x, written into `out` [T, H, P].

    x [T, H, P], b and c [T, H, N] (already one per head, repeated from their groups), each
    with a contiguous last dim; dt [T, H] contiguous (after softplus and clamp) and a [H] (the
    negative rates -exp(A_log)); any float dtype, computed in float32. `state` [slots, H, P, N]
    (float32, bfloat16 or float16, contiguous past the slot dim) holds request b's state at slot
    `slots[b]` (int64 [B], on the device, distinct): read from there, or zeros where
    `prefix_lens[b] == 0`, and the state after its last token written back in place, rounded to
    the buffer's dtype; no other slot is touched. Sequential over each request's tokens, so its
    output rounds as `Mamba2Mixer._step` run token by token."""
    tokens, heads, p = x.shape
    n = b.shape[-1]
    assert b.shape == c.shape == (tokens, heads, n) and out.shape == x.shape
    assert all(t.stride(-1) == 1 for t in (x, b, c, out)), "ssd needs contiguous heads"
    assert dt.shape == (tokens, heads) and a.shape == (heads,)
    assert dt.is_contiguous() and a.is_contiguous()
    assert state.shape[1:] == (heads, p, n) and state.stride()[1:] == (p * n, n, 1)
    assert len(prefix_lens) == len(extend_lens) == slots.numel() and sum(extend_lens) == tokens
    assert slots.dtype == torch.int64
    if not extend_lens:
        return
    runs, one_token = run_table(prefix_lens, extend_lens, x.device)
    block_n = triton.next_power_of_2(n)
    block_p = min(triton.next_power_of_2(p), max(1, TILE // block_n))
    grid = (len(extend_lens), heads, triton.cdiv(p, block_p))
    _ssd_kernel[grid](
        x,
        dt,
        a,
        b,
        c,
        out,
        state,
        slots,
        runs,
        x.stride(0),
        x.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        len(extend_lens),
        H=heads,
        P=p,
        N=n,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        ONE_TOKEN=one_token,
    )
