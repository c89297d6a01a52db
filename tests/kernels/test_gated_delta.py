"""The Gated DeltaNet kernel (`gated_delta_fwd`, interpreted on the CPU) against
`GatedDeltaNet.forward`'s CPU path: decode rows against `GatedDeltaNet._step` over the states
gathered from their slots, prefill runs (a one-token run among them, as in a mixed batch, and
one past `DELTA_CHUNK`) against `delta_chunk` a chunk at a time; several requests in shuffled
slots, fresh ones (their slots holding another request's leftovers, which must not be read) and
resumed ones, states stored in float32 and bfloat16, the whole buffer compared (no other slot
touched). Inputs in the model's ranges (L2-normed q and k, decays below 1, write strengths in
(0, 1)); head widths no power of two, so every tile is masked and Dv spans two tiles.

Run as a script (the last test runs it in a child process: this one's kernels are interpreted,
and an interpreted kernel compiles nothing), it compiles the kernel for sm_80 and sm_90 with
Triton's own compiler, no GPU needed, and prints one JSON object: for each case, its PTX's
global loads and stores by instruction.

    python -P tests/kernels/test_gated_delta.py
"""

from __future__ import annotations

import json

import gpu_compile
import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import gated_delta
from radixrt.models.layers import DELTA_CHUNK, GatedDeltaNet, delta_chunk

HEADS, DK, DV, SLOTS = 3, 12, 40, 6
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # float32 outputs, and float32 states


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta for `tokens` rows; v a view with a row stride past its width, as the
    forward's slice of the convolution's output is."""
    q = F.normalize(torch.randn(tokens, HEADS, DK), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(tokens, HEADS, DK), dim=-1)
    v = torch.randn(tokens, HEADS * DV + 8)[:, 8:].reshape(tokens, HEADS, DV)
    g = -2 * torch.rand(tokens, HEADS)
    beta = torch.rand(tokens, HEADS)
    return q, k, v, g, beta


def _kernel(
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    slots: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> torch.Tensor:
    """`gated_delta_fwd`'s output; `state` updated in place."""
    out = torch.empty(inputs[2].shape)
    slot_ids = torch.tensor(slots)
    gated_delta.gated_delta_fwd(*inputs, out, state, slot_ids, prefix_lens, extend_lens)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equal_the_cpu_step(dtype):
    torch.manual_seed(0)
    slots, prefix_lens = [4, 0, 2, 5], [9, 0, 3, 0]
    inputs = _inputs(len(slots))
    state = torch.randn(SLOTS, HEADS, DK, DV).to(dtype)
    want_state = state.clone()
    s = want_state.index_select(0, torch.tensor(slots)).float()
    s[torch.tensor(prefix_lens) == 0] = 0.0
    want = GatedDeltaNet._step(s, *inputs)
    want_state.index_copy_(0, torch.tensor(slots), s.to(dtype))

    got = _kernel(inputs, state, slots, prefix_lens, [1] * len(slots))
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(state, want_state, **(TOLERANCE if dtype == torch.float32 else {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_runs_equal_the_chunked_cpu_path(dtype):
    torch.manual_seed(1)
    slots, prefix_lens, extend_lens = [3, 5, 0, 1], [0, 4, 2, 0], [5, 1, DELTA_CHUNK + 3, 2]
    inputs = _inputs(sum(extend_lens))
    state = torch.randn(SLOTS, HEADS, DK, DV).to(dtype)
    want_state = state.clone()
    want, start = torch.empty(inputs[2].shape), 0
    for slot, prefix, n in zip(slots, prefix_lens, extend_lens):
        s = want_state[slot].float() if prefix else torch.zeros(HEADS, DK, DV)
        for a in range(start, start + n, DELTA_CHUNK):
            b = min(a + DELTA_CHUNK, start + n)
            want[a:b], s = delta_chunk(s, *(x[a:b] for x in inputs))
        want_state[slot] = s
        start += n

    got = _kernel(inputs, state, slots, prefix_lens, extend_lens)
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(state, want_state, **(TOLERANCE if dtype == torch.float32 else {}))


# Qwen3-Next's and Qwen3.5's linear attention: 32 value heads of 128 x 128 per layer
AOT_SHAPE = dict(H=32, DK=128, DV=128, BLOCK_K=128, BLOCK_V=gated_delta.BLOCK_V)
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
    pointers = {name: "*fp32" for name in ("Q", "K", "V", "G", "Beta", "O")}
    pointers |= {"State": f"*{state_dtype}", "slots": "*i64", "runs": "*i64"}
    ptx = gpu_compile.slot_kernel_ptx(gated_delta._gated_delta_kernel, constants, pointers, arch)
    return gpu_compile.global_accesses(ptx)


def test_compiles_for_sm80_and_sm90_moving_the_state_in_16_byte_vectors():
    """Each of the 128 threads holds 32 of a [128, 32] state tile's elements: they load and
    store as 16-byte vectors in either dtype, never an element at a time."""
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
