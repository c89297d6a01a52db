"""Mamba-2's recurrence kernel (`ssd_fwd`, interpreted on the CPU) against `Mamba2Mixer.forward`'s
CPU path: decode rows against `Mamba2Mixer._step` over the states gathered from their slots,
prefill runs (a one-token run among them, as in a mixed batch, and one over several chunks)
against `ssd_chunk` a chunk at a time; several requests in shuffled slots, fresh ones (their
slots holding stale values, which must not be read) and resumed ones, states stored in float32
and bfloat16, the whole buffer compared (no other slot touched). Inputs in the model's ranges
(time steps in Mamba-2's initial (0.001, 0.1), rates -exp(A_log) in [-16, -1]); P and N no power
of two and `TILE` lowered so a head's P rows span three tiles, the last one masked.

Run as a script (the last test runs it in a child process: this one's kernels are interpreted,
and an interpreted kernel compiles nothing), it compiles the kernel for sm_80 and sm_90 with
Triton's own compiler, no GPU needed, and prints one JSON object: for each case, its PTX's
global loads and stores by instruction.

    python -P tests/kernels/test_ssd.py
"""

from __future__ import annotations

import json
import math

import gpu_compile
import pytest
import torch

from radixrt.kernels import ssd
from radixrt.models.layers import Mamba2Mixer, ssd_chunk

HEADS, P, N, SLOTS, CHUNK = 3, 10, 12, 6, 4
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # float32 outputs, and float32 states


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Four rows of P a program (N pads to 16): P's 10 rows take three tiles."""
    monkeypatch.setattr(ssd, "TILE", 64)


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """x, dt, a, b, c for `tokens` rows; x a view with a row stride past its width, as the
    forward's split of the convolution's output is."""
    x = torch.randn(tokens, HEADS * P + 8)[:, 8:].reshape(tokens, HEADS, P)
    dt = torch.exp(torch.empty(tokens, HEADS).uniform_(math.log(1e-3), math.log(0.1)))
    a = -torch.exp(torch.rand(HEADS) * math.log(16))
    b, c = torch.randn(tokens, HEADS, N), torch.randn(tokens, HEADS, N)
    return x, dt, a, b, c


def _kernel(
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    slots: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> torch.Tensor:
    """`ssd_fwd`'s output; `state` updated in place."""
    out = torch.empty(inputs[0].shape)
    ssd.ssd_fwd(*inputs, out, state, torch.tensor(slots), prefix_lens, extend_lens)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equal_the_cpu_step(dtype):
    torch.manual_seed(0)
    slots, prefix_lens = [4, 0, 2, 5], [9, 0, 3, 0]
    inputs = _inputs(len(slots))
    state = torch.randn(SLOTS, HEADS, P, N).to(dtype)
    want_state = state.clone()
    s = want_state.index_select(0, torch.tensor(slots)).float()
    s[torch.tensor(prefix_lens) == 0] = 0.0
    want = Mamba2Mixer._step(s, *inputs)
    want_state.index_copy_(0, torch.tensor(slots), s.to(dtype))

    got = _kernel(inputs, state, slots, prefix_lens, [1] * len(slots))
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(state, want_state, **(TOLERANCE if dtype == torch.float32 else {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_runs_equal_the_chunked_cpu_path(dtype):
    torch.manual_seed(1)
    slots, prefix_lens, extend_lens = [3, 5, 0, 1], [0, 4, 2, 0], [5, 1, 2 * CHUNK + 1, 2]
    x, dt, a, b, c = inputs = _inputs(sum(extend_lens))
    state = torch.randn(SLOTS, HEADS, P, N).to(dtype)
    want_state = state.clone()
    want, start = torch.empty(x.shape), 0
    for slot, prefix, n in zip(slots, prefix_lens, extend_lens):
        s = want_state[slot].float() if prefix else torch.zeros(HEADS, P, N)
        for lo in range(start, start + n, CHUNK):
            hi = min(lo + CHUNK, start + n)
            want[lo:hi], s = ssd_chunk(s, x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi])
        want_state[slot] = s
        start += n

    got = _kernel(inputs, state, slots, prefix_lens, extend_lens)
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(state, want_state, **(TOLERANCE if dtype == torch.float32 else {}))


# Granite 4's Mamba-2 layers: 128 heads of 64 x 128 per layer
AOT_SHAPE = dict(H=128, P=64, N=128, BLOCK_P=ssd.TILE // 128, BLOCK_N=128)
AOT_STATES = {"fp32": 4, "bf16": 2}  # the state buffer's dtype: bytes an element
AOT_CASES = [
    (dtype, one, arch) for dtype in AOT_STATES for one in (True, False) for arch in (80, 90)
]


def _case(dtype: str, one_token: bool, arch: int) -> str:
    return f"{dtype} {'decode' if one_token else 'runs'} sm_{arch}"


def global_accesses(state_dtype: str, one_token: bool, arch: int) -> dict[str, int]:
    """The kernel over a `state_dtype` state buffer (decode rows if `one_token`, else runs),
    compiled for sm_`arch` at `AOT_SHAPE`: its PTX's global loads and stores by instruction.
    Pointers 16-byte aligned and strides multiples of 16, as torch allocates them at this shape
    and as Triton specializes such arguments on launch."""
    constants = {**AOT_SHAPE, "ONE_TOKEN": one_token}
    pointers = {name: "*fp32" for name in ("X", "DT", "A", "B", "C", "Y")}
    pointers |= {"State": f"*{state_dtype}", "slots": "*i64", "runs": "*i64"}
    ptx = gpu_compile.slot_kernel_ptx(ssd._ssd_kernel, constants, pointers, arch)
    return gpu_compile.global_accesses(ptx)


def test_compiles_for_sm80_and_sm90_moving_the_state_in_16_byte_vectors():
    """Each of the 128 threads holds 32 of a [32, 128] state tile's elements, contiguous along N
    in memory: they load and store as 16-byte vectors in either dtype, never one at a time."""
    accesses = gpu_compile.compiled_in_child(__file__)
    assert set(accesses) == {_case(*case) for case in AOT_CASES}
    for dtype, one_token, arch in AOT_CASES:
        case = _case(dtype, one_token, arch)
        widths, vectors = accesses[case], 32 * AOT_STATES[dtype] // 16
        assert widths.get("st.global.v4.b32") == vectors, f"{case}: {widths}"
        assert widths.get("ld.global.v4.b32", 0) >= vectors, f"{case}: {widths}"
        assert "ld.global.b16" not in widths and "st.global.b16" not in widths, (case, widths)


if __name__ == "__main__":
    print(json.dumps({_case(*case): global_accesses(*case) for case in AOT_CASES}))
