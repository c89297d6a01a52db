"""The causal convolution kernel (`causal_conv_fwd`, interpreted on the CPU) against
`causal_conv`'s CPU path: decode batches (all at once there) and batches of prefill runs (one
request at a time there: a one-token run among them, as in a mixed batch, and resumed runs
shorter than the state, so the slot keeps some of its older inputs); several requests in
shuffled slots, fresh ones (their slots holding stale inputs, which must not be read) and
resumed ones, activations, weights and states in float32 and bfloat16, the whole buffer compared
exactly (it holds inputs, never sums; no other slot touched). Four taps (the window exactly
theirs) without a bias and three (a zero column left of them) with one; C no power of two and
`TILE` lowered so the channels span three tiles, the last one masked.

Run as a script (the last test runs it in a child process: this one's kernels are interpreted,
and an interpreted kernel compiles nothing), it compiles the kernel for sm_80 and sm_90 with
Triton's own compiler, no GPU needed, and prints one JSON object: for each case, its PTX's
global loads and stores by instruction and its shared memory in bytes.

    python -P tests/kernels/test_causal_conv.py
"""

from __future__ import annotations

import json
import re
from collections import Counter

import gpu_compile
import pytest
import torch

from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import causal_conv as conv_kernel
from radixrt.models.layers import causal_conv

CHANNELS, SLOTS = 10, 6
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: {}}
SHAPES = [(4, False), (3, True)]  # taps, and whether there is a bias


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Four channels a program (the taps pad to a window of 4): C's 10 take three tiles."""
    monkeypatch.setattr(conv_kernel, "TILE", 16)


def _batch(slots: list[int], prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
    """What `causal_conv` reads of a batch: its runs and their state slots."""
    tokens = torch.zeros(sum(extend_lens), dtype=torch.int64)
    rows = torch.arange(len(slots))
    return ForwardBatch(
        tokens, tokens, tokens, rows, prefix_lens, extend_lens, state_slots=torch.tensor(slots)
    )


def _check(dtype, taps, with_bias, slots, prefix_lens, extend_lens):
    """The kernel's output and state buffer against the CPU path's, from the same start."""
    tokens = sum(extend_lens)
    x = torch.randn(tokens, CHANNELS + 8)[:, 8:].to(dtype)  # a row stride past the width
    weight = torch.randn(CHANNELS, 1, taps).to(dtype)
    bias = torch.randn(CHANNELS).to(dtype) if with_bias else None
    state = torch.randn(SLOTS, CHANNELS, taps - 1).to(dtype)
    want_state = state.clone()
    want = causal_conv(x, weight, bias, want_state, _batch(slots, prefix_lens, extend_lens))

    runs = (torch.tensor(slots), prefix_lens, extend_lens)
    got = conv_kernel.causal_conv_fwd(x, weight, bias, state, *runs)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)


@pytest.mark.parametrize("taps,with_bias", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equal_the_cpu_path(dtype, taps, with_bias):
    torch.manual_seed(0)
    _check(dtype, taps, with_bias, [4, 0, 2, 5], [9, 0, 3, 0], [1, 1, 1, 1])


@pytest.mark.parametrize("taps,with_bias", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_runs_equal_the_cpu_path(dtype, taps, with_bias):
    torch.manual_seed(1)
    _check(dtype, taps, with_bias, [3, 5, 0, 1, 4], [0, 4, 2, 0, 7], [5, 1, 2, 7, 1])


# Qwen3-Next's Gated DeltaNet convolution: q, k and v's 8192 channels, 4 taps
AOT_SHAPE = dict(C=8192, TAPS=4, WINDOW=4, BLOCK_C=conv_kernel.TILE // 4, HAS_BIAS=False)
AOT_DTYPES = ("fp32", "bf16")  # activations, weights and state alike
AOT_CASES = [
    (dtype, one, arch) for dtype in AOT_DTYPES for one in (True, False) for arch in (80, 90)
]


def _case(dtype: str, one_token: bool, arch: int) -> str:
    return f"{dtype} {'decode' if one_token else 'runs'} sm_{arch}"


def compiled_kernel(dtype: str, one_token: bool, arch: int) -> dict[str, dict[str, int]]:
    """The kernel over `dtype` tensors (decode rows if `one_token`, else runs), compiled for
    sm_`arch` at `AOT_SHAPE`: its PTX's global loads and stores, and its warp shuffles and
    local (spilled) accesses, by instruction. Pointers 16-byte aligned and strides multiples of
    16, as torch allocates them at this shape and as Triton specializes such arguments on
    launch."""
    constants = {**AOT_SHAPE, "ONE_TOKEN": one_token}
    pointers = {name: f"*{dtype}" for name in ("X", "Weight", "Bias", "Out", "State")}
    pointers |= {"slots": "*i64", "runs": "*i64"}
    ptx = gpu_compile.slot_kernel_ptx(conv_kernel._causal_conv_kernel, constants, pointers, arch)
    return {
        "global": gpu_compile.global_accesses(ptx),
        "other": dict(Counter(re.findall(r"shfl\.sync\.\w+|(?:ld|st)\.local", ptx))),
    }


def test_compiles_for_sm80_and_sm90_sliding_the_window_in_registers():
    """Each of the 128 threads holds 8 of a [256, 4] window's elements, one column of 8 rows
    (the 4 columns of a row on 4 lanes): the shift is one shuffle an element between lanes,
    never a trip through memory, and nothing spills. Each token's output leaves as one store a
    thread, its 2 channels together."""
    compiled = gpu_compile.compiled_in_child(__file__)
    assert set(compiled) == {_case(*case) for case in AOT_CASES}
    for dtype, one_token, arch in AOT_CASES:
        case = _case(dtype, one_token, arch)
        accesses, other = compiled[case]["global"], compiled[case]["other"]
        assert other.get("shfl.sync.idx") == 8, f"{case}: {other}"
        assert "ld.local" not in other and "st.local" not in other, f"{case}: {other}"
        out_store = "st.global.v2.b32" if dtype == "fp32" else "st.global.b32"
        assert accesses.get(out_store) == 1, f"{case}: {accesses}"


if __name__ == "__main__":
    print(json.dumps({_case(*case): compiled_kernel(*case) for case in AOT_CASES}))
