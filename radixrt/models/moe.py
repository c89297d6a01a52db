"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, Granite 4): top-k routing, then each
expert run once over the tokens routed to it.

Routing is transformers' arithmetic: softmax of the router logits in float32, the top k, and
(where the family renormalises) those k divided by their sum; or, for Granite 4, the top k
logits and the softmax of those k. Experts are grouped, not looped per token: the (token,
expert) pairs are sorted by expert, so each expert is two matmuls over its own rows, and each
token's outputs are summed in expert order, as transformers sums them.
Experts are `GatedMLP`s, as the dense MLP, so the CPU's oneDNN prepacking and
`--quantization int8` replace their linears too. On the GPU the experts run as two fused Triton
launches instead (`kernels/fused_moe.py`), over their weights stacked once by expert. Under
`--tp-size N` every rank holds every expert's slice of the intermediate dimension (as the dense
MLP); with `--ep-size N` too, each rank holds a share of the experts whole and runs only the
pairs routed to them. Either way every rank sees every token (the attention's all-reduce left
the stream whole on each) and routes it, and one all-reduce sums the ranks' parts. A shared
expert (Qwen3-Next, Qwen3.5-MoE; Granite 4's shared MLP, ungated) is whole on every rank and
added after that all-reduce. (SGLang's first EP layout: no all-to-all dispatch, which pays only
when tokens are spread over ranks.)
The CPU's grouping reads the per-expert counts on the host; the fused path reads nothing back
but has not yet run under CUDA-graph capture, so a decode step of an MoE model is not captured
(the model says so with `graph_safe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

import radixrt.kernels as kernels
from radixrt.distributed.group import TPGroup
from radixrt.kernels import cpu_fused
from radixrt.models.family import MoeSpec


@dataclass(frozen=True)
class Routing:
    """Each token's `top_k` experts [T, k] (int64) and their weights [T, k] (float32)."""

    experts: torch.Tensor
    weights: torch.Tensor


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, top_k_first: bool = False
) -> Routing:
    """Top-k of the softmax of router `logits` [T, E], renormalised to sum to 1 if asked; or,
    `top_k_first` (`MoeSpec`), the softmax of the top-k logits."""
    if top_k_first:
        top, experts = torch.topk(logits.float(), top_k, dim=-1)
        return Routing(experts, torch.softmax(top, dim=-1))
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


def gated(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] -> act(gate) * up, [T, I]: SiLU (one fused call on the CPU in float32) or
    Gemma's tanh-approximated GELU."""
    if activation == "silu" and cpu_fused.supports(gate_up):
        out: torch.Tensor = cpu_fused.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up  # support.py refused any other


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one projection: one expert, or, with an
    all-reduce after it, the dense MLP. Its `nn.Linear`s are what `--quantization int8` and
    the CPU's prepacking replace, experts' as the dense MLP's."""

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(gated(self.gate_up_proj(x), self.activation))
        return out


class Experts(Sized, Iterable[Callable[[torch.Tensor], torch.Tensor]], Protocol):
    """Experts first to last: an `nn.ModuleList` of them (not a Sequence to the type checker)
    or a list of callables."""


def grouped_experts(
    x: torch.Tensor,
    routing: Routing,
    experts: Experts,
    first: int = 0,
) -> torch.Tensor:
    """sum_j weights[t, j] * experts[experts_of[t, j] - first](x[t]) for every token t, over the
    pairs routed to experts `first` to `first + len(experts)` (the rest are other ranks'), each
    expert called once, over the rows routed to it."""
    top_k = routing.experts.shape[1]
    flat = routing.experts.flatten()
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens ascending within one
    counts = torch.bincount(flat, minlength=first + len(experts)).tolist()
    tokens, weights = order // top_k, routing.weights.flatten()[order]
    out = torch.zeros_like(x)
    start = sum(counts[:first])
    for expert, n in zip(experts, counts[first:]):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        h = expert(x[rows])
        out.index_add_(0, rows, h * weights[start : start + n, None].to(h.dtype))
        start += n
    return out


class SparseMoE(nn.Module):
    """The whole router, and this rank's experts (`expert_ids`, first to last, default all),
    each `intermediate` wide (its slice under TP, whole under EP); the shared expert and its
    gate (where `shared_gate`), whole, where the spec has one."""

    def __init__(
        self,
        hidden: int,
        spec: MoeSpec,
        intermediate: int,
        tp: TPGroup,
        activation: str,
        expert_ids: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.spec = spec
        self.activation = activation
        self.first, last = expert_ids or (0, spec.num_experts)
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, intermediate, activation) for _ in range(last - self.first)
        )
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, spec.shared_intermediate_size, activation)
            if spec.shared_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        routing = route(self.gate(x), spec.top_k, spec.renormalize, spec.top_k_first)
        if x.is_cuda:
            out = self.tp.all_reduce(self.fused(x, routing))
        else:
            out = self.tp.all_reduce(grouped_experts(x, routing, self.experts, self.first))
        if self.shared_expert is None:
            return out
        shared: torch.Tensor = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def fused(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`grouped_experts` as the fused Triton kernel computes it (the GPU's path; the tests
        run it under Triton's interpreter). Pairs routed to another rank's experts take the
        kernel's dropped id (one past this rank's last expert)."""
        gate_up, down = self.stacked_weights()
        local = routing.experts - self.first
        held = len(self.experts)
        local = local.masked_fill((local < 0) | (local >= held), held)
        out: torch.Tensor = kernels.fused_moe_fwd(
            x,
            local,
            routing.weights,
            gate_up,
            down,
            lambda h: gated(h, self.activation),
        )
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's gate_up and down weights, [E, 2I, H] and [E, H, I]: stacked on the first
        call (after loading), each expert's linear then re-pointed to its slice so the weights
        are held once. Only plain `nn.Linear` experts stack (the GPU has no prepacked or int8
        ones)."""
        if self._stacked is None:
            stacks = []
            for proj in ("gate_up_proj", "down_proj"):
                linears = [getattr(expert, proj) for expert in self.experts]
                stacked = torch.stack([linear.weight.detach() for linear in linears])
                for linear, weight in zip(linears, stacked):
                    linear.weight.data = weight
                stacks.append(stacked)
            self._stacked = (stacks[0], stacks[1])
        return self._stacked
