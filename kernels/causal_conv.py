"""The depthwise causal convolution of the recurrent mixers (Mamba-2, Gated DeltaNet, LFM2's
short convolution) on the GPU, over the per-slot states in place: one launch for a whole batch,
decode rows and prefill runs alike.

Channel c's output at a token is the dot product of its `taps` weights with its last `taps`
inputs, the token's own last; the `taps - 1` before a request's first new token are its slot's
state (zeros for a request starting at position 0), as `layers.causal_conv` does on the CPU.
The channels are independent, so a program holds one (request, tile of channels)'s window of
inputs in registers, in float32, and slides it over the request's tokens: a shift by one column
(a gather along the row: shuffles between lanes, not memory) and the token's input in the last
column. It writes the window's last `taps - 1` inputs back to the slot in the buffer's dtype:
the state is read and written once per launch, and each input read once, however long the run.

A decode step is B runs of one token, row b request b's. A prefill run slides token by token
too: a long prompt's C / BLOCK_C programs each take its tokens one after another, where a
convolution over all of them at once would spread them over more programs; in return the one
kernel serves decode rows and prefill runs in the same batch. The run table is the one
`gated_delta` builds (`run_table`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_delta import run_of, run_table
from .jit import jit


@jit
def _causal_conv_kernel(
    X: tl.tensor,
    Weight: tl.tensor,
    Bias: tl.tensor,
    Out: tl.tensor,
    State: tl.tensor,
    slots: tl.tensor,
    runs: tl.tensor,
    stride_xt: tl.tensor,
    stride_ot: tl.tensor,
    stride_slot: tl.tensor,
    num_runs: tl.tensor,
    C: tl.constexpr,
    TAPS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
) -> None:
    """Run program_id(0)'s tokens through channels program_id(1) * BLOCK_C onwards. `runs` as
    `run_table` lays it out (num_runs to a row). The window is [BLOCK_C, WINDOW], WINDOW the
    power of two at or above TAPS: the taps right-aligned (column WINDOW - 1 the newest input),
    any columns left of them zeros that stay zeros (each takes column 0, itself one of them).
    Weight is [C, TAPS] and Bias [C] contiguous (Bias unread unless HAS_BIAS); the state buffer
    [slots, C, TAPS - 1] contiguous past the slot, its slot ids int64 so their offsets cannot
    overflow."""
    r = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    js = tl.arange(0, WINDOW)
    c_in = cs < C
    first, n, fresh = run_of(runs, num_runs, r, ONE_TOKEN)
    tap = js - (WINDOW - TAPS)  # column j's tap, negative left of the taps
    taps_in = c_in[:, None] & (tap >= 0)[None, :]
    weight = tl.load(Weight + cs[:, None] * TAPS + tap[None, :], mask=taps_in, other=0.0)
    weight = weight.to(tl.float32)
    # Between tokens the window's last TAPS - 1 columns hold the inputs the state keeps.
    held = tap - 1
    cells = State + tl.load(slots + r) * stride_slot + cs[:, None] * (TAPS - 1) + held[None, :]
    in_tile = c_in[:, None] & (held >= 0)[None, :]
    stored = tl.where(fresh, 0, TAPS - 1)  # the slot's inputs: none if fresh
    window = tl.load(cells, mask=in_tile & (held < stored)[None, :], other=0.0).to(tl.float32)
    source = tl.where(tap >= 0, tl.minimum(js + 1, WINDOW - 1), 0)  # the column each one takes
    source = tl.broadcast_to(source[None, :], (BLOCK_C, WINDOW))
    if HAS_BIAS:
        bias = tl.load(Bias + cs, mask=c_in, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_C,), tl.float32)
    for t in range(0, n):
        row = first + t
        x = tl.load(X + row * stride_xt + cs, mask=c_in, other=0.0).to(tl.float32)
        window = tl.gather(window, source, axis=1)
        window = tl.where(js[None, :] == WINDOW - 1, x[:, None], window)
        y = tl.sum(window * weight, axis=1) + bias
        tl.store(Out + row * stride_ot + cs, y.to(Out.dtype.element_ty), mask=c_in)
    tl.store(cells, window.to(State.dtype.element_ty), mask=in_tile)


TILE = 1024  # window elements per program: 8 float32 registers a thread over 4 warps


def causal_conv_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
) -> torch.Tensor:
    """The depthwise causal convolution of B requests' new tokens, back to back (request b's
    `extend_lens[b]` rows after the earlier requests'), by `weight` [C, 1, taps] (2 <= taps,
    contiguous) plus `bias` [C] where given, in one launch: [T, C] in x's dtype.

    x [T, C] with contiguous channels; any float dtypes, computed in float32. `state` [slots, C,
    taps - 1] (contiguous past the slot dim, in x's dtype or a wider one, so the inputs it keeps
    are exact) holds request b's last inputs at slot `slots[b]` (int64 [B], on the device,
    distinct), the oldest first: read from there, or zeros where `prefix_lens[b] == 0`, and the
    request's last taps - 1 inputs (its own and, for a run shorter than that, the slot's) written
    back in place; no other slot is touched."""
    tokens, channels = x.shape
    taps = weight.shape[-1]
    assert weight.shape == (channels, 1, taps) and weight.is_contiguous() and taps >= 2
    assert bias is None or (bias.shape == (channels,) and bias.is_contiguous())
    assert x.stride(1) == 1, "causal_conv needs contiguous channels"
    assert state.shape[1:] == (channels, taps - 1) and state.stride()[1:] == (taps - 1, 1)
    assert len(prefix_lens) == len(extend_lens) == slots.numel() and sum(extend_lens) == tokens
    assert slots.dtype == torch.int64
    out = x.new_empty(tokens, channels)
    if not extend_lens:
        return out
    runs, one_token = run_table(prefix_lens, extend_lens, x.device)
    window = triton.next_power_of_2(taps)
    block_c = min(triton.next_power_of_2(channels), max(1, TILE // window))
    grid = (len(extend_lens), triton.cdiv(channels, block_c))
    _causal_conv_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        out,
        state,
        slots,
        runs,
        x.stride(0),
        out.stride(0),
        state.stride(0),
        len(extend_lens),
        C=channels,
        TAPS=taps,
        WINDOW=window,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        ONE_TOKEN=one_token,
    )
    return out
