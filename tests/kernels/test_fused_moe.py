"""The fused MoE kernel (interpreted on the CPU) against the CPU's grouped experts, at odd
shapes: 1, 5 and 64 tokens, 4 and 8 experts, top 1 and 2, widths no power of two (so every tile
is masked), some experts receiving no token."""

import os

# before triton.jit runs on import of radixrt.kernels (conftest does it too)
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from radixrt.distributed.group import TPGroup  # noqa: E402
from radixrt.distributed.sharding import split_range  # noqa: E402
from radixrt.kernels import fused_moe  # noqa: E402
from radixrt.models.family import MoeSpec  # noqa: E402
from radixrt.models.moe import SparseMoE, grouped_experts, route  # noqa: E402

HIDDEN, INTERMEDIATE = 40, 24


def _moe(num_experts: int, top_k: int) -> SparseMoE:
    names = ("gate_proj", "up_proj", "down_proj")
    spec = MoeSpec(num_experts, top_k, INTERMEDIATE, True, "mlp", names, frozenset())
    moe = SparseMoE(HIDDEN, spec, INTERMEDIATE, TPGroup(), "silu")
    torch.manual_seed(num_experts * 10 + top_k)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe


@pytest.mark.parametrize("num_experts, top_k", [(4, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_fused_moe_equals_grouped_experts(tokens, num_experts, top_k):
    moe = _moe(num_experts, top_k)
    x = torch.randn(tokens, HIDDEN)
    routing = route(moe.gate(x), top_k, renormalize=True)
    with torch.no_grad():
        want = grouped_experts(x, routing, moe.experts)
        got = moe.fused(x, routing)
        again = grouped_experts(x, routing, moe.experts)  # the experts read their stacked slices
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, want, atol=0, rtol=0)


@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_parallel_shares_sum_to_the_whole(ranks):
    """Under `--ep-size`, each rank runs only the pairs routed to its share of the experts (the
    fused kernel drops the others'): the ranks' outputs, summed as the all-reduce sums them,
    equal one rank's with every expert, on the CPU's grouping and the fused kernel alike."""
    moe = _moe(8, 2)
    x = torch.randn(23, HIDDEN)
    routing = route(moe.gate(x), 2, renormalize=True)
    with torch.no_grad():
        want = grouped_experts(x, routing, moe.experts)
        grouped, fused = torch.zeros_like(want), torch.zeros_like(want)
        for rank in range(ranks):
            first, last = split_range(8, ranks, rank)
            share = SparseMoE(HIDDEN, moe.spec, INTERMEDIATE, TPGroup(), "silu", (first, last))
            share.experts = torch.nn.ModuleList(list(moe.experts)[first:last])
            grouped += grouped_experts(x, routing, share.experts, first)
            fused += share.fused(x, routing)
    torch.testing.assert_close(grouped, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused, want, atol=1e-5, rtol=1e-5)


def test_fused_moe_in_half_precision():
    """The GPU's dtypes: fp16 in, fp32 accumulation, fp16 out (fp16 stands in for bf16: the
    interpreter's tl.dot multiplies bf16 tensors as their raw uint16 bits)."""
    moe = _moe(8, 2).half().float()  # weights and input that fp16 holds exactly
    x = torch.randn(5, HIDDEN).half().float()
    routing = route(moe.gate(x), 2, renormalize=True)
    with torch.no_grad():
        want = grouped_experts(x, routing, moe.experts)
        got = moe.half().fused(x.half(), routing)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=5e-3, rtol=5e-3)


def test_alignment_pads_each_expert_to_whole_blocks():
    """Pairs sorted by expert, each expert's run padded to a block with the sentinel (T * k),
    blocks past the last expert's marked -1; an expert with no pair has no block."""
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_pairs, block_experts = fused_moe.align_by_expert(experts, 4, block_m=4)
    assert sorted_pairs.tolist()[:8] == [1, 4, 6, 6, 0, 2, 5, 6]
    assert block_experts.tolist()[:3] == [0, 2, 3]
    assert sorted_pairs.tolist()[8] == 3 and set(sorted_pairs.tolist()[9:]) == {6}
    assert set(block_experts.tolist()[3:]) == {-1}


def test_alignment_sorts_dropped_pairs_last_in_blocks_never_run():
    """Pairs of the dropped id (E: another rank's expert) sort after every expert's, in blocks
    marked -1, and the rows sized for the worst routing still hold them."""
    experts = torch.tensor([[4, 0], [4, 4], [0, 4]])
    sorted_pairs, block_experts = fused_moe.align_by_expert(experts, 4, block_m=4)
    assert sorted_pairs.tolist()[:4] == [1, 4, 6, 6]
    assert block_experts.tolist()[0] == 0 and set(block_experts.tolist()[1:]) == {-1}
    assert sorted(sorted_pairs.tolist()[4:8]) == [0, 2, 3, 5]
