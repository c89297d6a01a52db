"""Fused mixture-of-experts projections (GPU): the (token, expert) pairs sorted by expert and each
expert's pairs padded to whole row blocks, then one launch per projection over (row block, N
tile), each program multiplying its block's rows by its expert's weight tile (the `fused_moe`
shape of SGLang and vLLM). Nothing is read back to the host, so the launch sizes hold for any
routing: the grid covers the most blocks any routing can need and the surplus exits at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .extend_attention import dot_precision
from .jit import jit


@jit
def _expert_matmul_kernel(
    A: tl.tensor,
    B: tl.tensor,
    C: tl.tensor,
    sorted_pairs: tl.tensor,
    block_experts: tl.tensor,
    pair_weights: tl.tensor,
    num_pairs: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_am: tl.tensor,
    stride_be: tl.tensor,
    stride_bn: tl.tensor,
    stride_cm: tl.tensor,
    A_ROW_DIV: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    """C[p, n-tile] = A[p // A_ROW_DIV] @ B[expert]^T for the pairs p of row block
    program_id(0) (times the pair's routing weight if WEIGHTED); padding rows (p >= num_pairs)
    and blocks past the last expert's (expert -1) are skipped."""
    expert = tl.load(block_experts + tl.program_id(0))
    if expert < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs + rows)
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = A + (pairs // A_ROW_DIV)[:, None] * stride_am
    b_cols = B + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if WEIGHTED:
        acc *= tl.load(pair_weights + pairs, mask=valid, other=0.0)[:, None]
    out = C + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of `experts` [T, k] (pair p = token p // k's j-th expert) sorted by expert, each
    expert's run padded to a multiple of `block_m` with the sentinel T * k: (sorted_pairs, one
    entry per block of `block_m`, its expert or -1 past the last). Pairs of the dropped id
    `num_experts` sort last, in blocks marked -1. Sized for the worst routing,
    T * k + (E + 1) * (block_m - 1) rows, so no count comes back to the host."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[by_expert]
    padded_starts = padded_ends - padded
    rows = triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[padded_starts[by_expert] + rank] = order
    block_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts[block_experts >= num_experts] = -1
    return sorted_pairs, block_experts


BLOCK_M = 16


def fused_moe_fwd(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ activation(gate_up[e] @ x[t]) with e = experts[t, j], for
    x [T, H], routing `experts` and `weights` [T, k], `gate_up` [E, 2I, H] and `down` [E, H, I]:
    two launches (the routing weight applied in the second) and `activation` [T*k, 2I] -> [T*k, I]
    between them. The k outputs of a token are summed in routing order, not expert order. A pair
    whose expert is E (another rank's, under expert parallelism) adds nothing."""
    tokens, top_k = experts.shape
    sorted_pairs, block_experts = align_by_expert(experts, gate_up.shape[0], BLOCK_M)
    pairs = (sorted_pairs, block_experts, tokens * top_k)
    h = expert_matmul(x, gate_up, *pairs, a_row_div=top_k)
    y = expert_matmul(activation(h), down, *pairs, a_row_div=1, pair_weights=weights.flatten())
    return y.view(tokens, top_k, -1).sum(dim=1)


def expert_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_pairs, N]: row p = a[p // a_row_div] @ weights[expert of p]^T (times the float32
    pair_weights[p] if given), `weights` [E, N, K] in `nn.Linear`'s layout; one launch."""
    assert a.stride(-1) == 1 and weights.stride(-1) == 1, "fused_moe needs contiguous rows"
    n, k = weights.shape[1], weights.shape[2]
    out = torch.zeros(num_pairs, n, dtype=a.dtype, device=a.device)  # dropped pairs' rows stay 0
    block_n = min(64, max(16, triton.next_power_of_2(n)))  # tl.dot's least tile is 16
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a,
        weights,
        out,
        sorted_pairs,
        block_experts,
        pair_weights if pair_weights is not None else out,
        num_pairs,
        n,
        k,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        WEIGHTED=pair_weights is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=min(64, max(16, triton.next_power_of_2(k))),
        DOT_PRECISION=dot_precision(a.dtype),
    )
    return out
