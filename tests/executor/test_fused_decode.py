"""One native call per decode step (`kernels/cpu_layer`, `models/fused_decode`): on a model and a
step that qualify, every layer runs inside one C call, and the logits are the per-op path's bit
for bit (the same kernels' bodies, the same order), step after step, for one stream and for
several of different lengths, on each native `--cpu-isa` path, int4 and int8 weights; 5-, 6-
and 8-bit groups and IQ4's too. Steps that do
not qualify (a prefill, a shared prefix split off) and models that do not (float linears, the
torch path) keep the per-op path."""

from __future__ import annotations

import pytest
import torch

from radixrt.config import ServerArgs
from radixrt.executor.model_runner import ModelRunner
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_isa, int4_gemm
from radixrt.models.fused_decode import FusedDecode, _decode_only
from radixrt.models.linear import GroupedLinear

NATIVE = [isa.value for isa in cpu_isa.NEEDS if isa in cpu_isa.host_paths()]


def _runner(model_dir, **settings) -> ModelRunner:
    args = ServerArgs(model=str(model_dir), max_total_tokens=1024, **settings)
    return ModelRunner(args.executor)


def _steps(
    runner: ModelRunner, fused: bool | None, prompts: list[int], steps: int
) -> list[torch.Tensor]:
    """Prefill requests of `prompts` tokens (rows 1.., disjoint slots: no shared prefix), then
    decode them together `steps` times greedily; each step's logits. `fused` False keeps the
    per-op path for every step, True decides the fused path anew, None keeps what the model
    has."""
    model = runner.model
    if fused is not None:
        model._fused, model._fused_checked = None, not fused
    table = runner.req_to_token_pool.req_to_token
    firsts, at = [], 1
    for row, n in enumerate(prompts, start=1):
        table[row, : n + steps] = torch.arange(at, at + n + steps, dtype=torch.int32)
        firsts.append(at)
        at += n + steps
    ids = torch.cat([torch.arange(100 + r, 100 + r + n) for r, n in enumerate(prompts)])
    positions = torch.cat([torch.arange(n) for n in prompts])
    slots = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, prompts)])
    rows = torch.arange(1, len(prompts) + 1)
    batch = ForwardBatch(ids, positions, slots, rows, [0] * len(prompts), list(prompts))
    logits = runner.logits(runner.forward(batch))
    out, lens = [], list(prompts)
    for _ in range(steps):
        last = logits[torch.tensor(lens).cumsum(0) - 1] if len(out) == 0 else logits
        out.append(last)
        nxt = last.argmax(-1)
        batch = ForwardBatch(
            nxt,
            torch.tensor(lens),
            torch.tensor([f + n for f, n in zip(firsts, lens)]),
            rows,
            list(lens),
            [1] * len(lens),
        )
        if fused is not False:
            runner.attn_backend.init_forward_metadata(batch)
            assert _decode_only(batch, runner.attn_backend) is not None, "a step fell back"
        logits = runner.logits(runner.forward(batch))
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize(
    "quantization, prompts", [("int4", [40]), ("int4", [40, 7, 23]), ("int8", [40, 7, 23])]
)
def test_the_fused_step_gives_the_per_op_bits(small_model_dir, isa, quantization, prompts):
    """The default model's first layers in int4 and int8, one stream and three of different
    lengths, 6 decode steps."""
    runner = _runner(small_model_dir, quantization=quantization, cpu_isa=isa)
    per_op = _steps(runner, False, prompts, 6)
    fused = _steps(runner, True, prompts, 6)
    assert runner.model._fused is not None
    assert all(torch.equal(a, b) for a, b in zip(per_op, fused))


def test_eight_bit_groups_and_a_weight_swap(tiny_model_dir):
    """GGUF's Q8_0 layout (8-bit groups) in every linear; then the layers' weights replaced by
    4-bit ones, as a weight update replaces them: the fused path's records follow."""
    runner = _runner(tiny_model_dir, quantization="int4")
    linears = [m for m in runner.model.layers.modules() if isinstance(m, GroupedLinear)]
    floats = [lin.weight.dequantize() for lin in linears]
    for lin, w in zip(linears, floats):
        lin.weight = int4_gemm.PackedGroups.quantize(w, int4_gemm.Bits.INT8)
    per_op, fused = _steps(runner, False, [9, 30], 4), _steps(runner, True, [9, 30], 4)
    assert all(torch.equal(a, b) for a, b in zip(per_op, fused))
    for lin, w in zip(linears, floats):
        lin.weight = int4_gemm.PackedGroups.quantize(w)
    fused = _steps(runner, None, [9, 30], 4)  # the records built on the 8-bit weights
    per_op = _steps(runner, False, [9, 30], 4)
    assert all(torch.equal(a, b) for a, b in zip(per_op, fused))


@pytest.mark.parametrize("settings", [{}, {"quantization": "int4", "cpu_isa": "torch"}])
def test_models_that_do_not_qualify_keep_the_per_op_path(tiny_model_dir, settings):
    """Float linears (oneDNN's) and the torch path's dequantized ones have no fused form."""
    runner = _runner(tiny_model_dir, **settings)
    assert FusedDecode.of(runner.model) is None


@pytest.mark.parametrize("bits", [int4_gemm.Bits.INT5, int4_gemm.Bits.INT6, int4_gemm.Bits.IQ4])
def test_five_six_bit_and_iq4_groups(tiny_model_dir, bits):
    """GGUF's Q5 (with offsets: Q5_1, Q5_K), Q6_K and IQ4 layouts in every linear, random blocks
    at each linear's shape: the fused step gives the per-op bits."""
    runner = _runner(tiny_model_dir, quantization="int4")
    gen = torch.Generator().manual_seed(int(bits))
    for lin in [m for m in runner.model.layers.modules() if isinstance(m, GroupedLinear)]:
        n, k = lin.weight.out_features, lin.weight.in_features
        groups = -(-k // 32)
        q = torch.randint(0, 256, (n, groups, bits.group_bytes), dtype=torch.uint8, generator=gen)
        halves = (2,) if bits == int4_gemm.Bits.INT6 else ()
        d = (torch.rand(n, groups, *halves, generator=gen) / 64).half()
        offsets = bits == int4_gemm.Bits.INT5
        m = (torch.randn(n, groups, generator=gen) / 64).half() if offsets else None
        lin.weight = int4_gemm.PackedGroups.from_blocks(q, d, m, k, bits)
    per_op, fused = _steps(runner, False, [9, 30], 4), _steps(runner, True, [9, 30], 4)
    assert runner.model._fused is not None
    assert all(torch.equal(a, b) for a, b in zip(per_op, fused))
