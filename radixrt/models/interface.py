"""What the executor reads of a model, and what a model reads its weights from.

`CausalLM` is the contract every architecture class keeps: `ModelRunner` sizes the KV pool from
`kv_layers`, `shard` and `head_dim`, allocates a recurrent model's per-request states, picks
attention options from `family`, quantizes the `nn.Linear`s and `lm_head`, captures CUDA graphs
only where `graph_safe`, and gathers tensor-parallel logits by `vocab_widths`; LoRA and the
fused decode reach a layer's linears through `projections`, never through a family's attribute
names (weight updates load a second model and swap its modules in whole). `WeightSource` is the
reader a model's `load_weights` copies its tensors from (`executor.model_loader.WeightReader` is
the one that reads safetensors); it is declared here so that models depend on nothing above
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from radixrt.attention import AttentionBackend
from radixrt.distributed.sharding import HeadShard
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels.int4_gemm import PackedGroups
from radixrt.models.family import Family


class WeightSource(Protocol):
    """A checkpoint's tensors by name, copied into parameters (cast to their dtype and device);
    a tensor-parallel rank reads only its own rows."""

    def whole(self, name: str) -> torch.Tensor:
        """A small tensor (a norm), whole and as stored."""
        ...

    def copy_rows(
        self, out: torch.Tensor, name: str, start: int | None = None, end: int | None = None
    ) -> None:
        """Rows [start, end) of a tensor (all of it without bounds) into `out`."""
        ...

    def stack_rows(self, out: torch.Tensor, parts: list[tuple[str, int, int]]) -> None:
        """Rows [start, end) of each (name, start, end), one after the other, into `out`."""
        ...

    def copy_cols(self, out: torch.Tensor, name: str, start: int, end: int) -> None:
        """Columns [start, end) of a matrix into `out`."""
        ...

    def skip(self, name: str) -> None:
        """A tensor another rank loads: checked present and counted as read."""
        ...


@dataclass(frozen=True)
class Projection:
    """One linear of one layer that adapters reach: the module holding it and its attribute
    there (the linear itself may be replaced, packed or wrapped, so it is looked up each time),
    the checkpoint's projections its output rows fuse (peft's names: q, k, v; gate, up), this
    rank's rows [start, end) of each and each one's whole width, the whole input width, and for
    a row-parallel linear this rank's columns [start, end) of that input (None: all of it)."""

    owner: nn.Module
    attr: str
    parts: tuple[str, ...]
    rows: tuple[tuple[int, int], ...]
    full_out: tuple[int, ...]
    full_in: int
    cols: tuple[int, int] | None = None

    @property
    def linear(self) -> nn.Module:
        """The module now in place (read from `_modules`: `nn.Module.__getattr__` costs a
        microsecond, and the fused decode reads every layer's linears each step)."""
        return self.owner._modules[self.attr]  # type: ignore[return-value]

    @property
    def width(self) -> int:
        """This rank's input width."""
        return self.full_in if self.cols is None else self.cols[1] - self.cols[0]

    @property
    def out(self) -> int:
        """This rank's output width."""
        return sum(end - start for start, end in self.rows)


class CausalLM(nn.Module):
    """A decoder the executor can serve: built on the meta device from (config, max_positions,
    tp), filled by `load_weights`, run on a `ForwardBatch` to hidden states, and turned into this
    rank's slice of the logits by `compute_logits`. A base class, not a protocol: the executor
    passes the model both to what reads these members and to what walks it as an `nn.Module`
    (quantization, LoRA, CUDA graphs), and the loader refuses a class that does not derive it."""

    family: Family  # the parts the architecture swaps in (windows, softcaps, ...)
    shard: HeadShard  # this rank's attention heads: the KV pool holds `shard.num_kv_heads`
    head_dim: int
    kv_layers: int  # the layers whose K/V the pool holds (those that attend)
    # whether a request carries state besides its KV (a convolution's or a recurrence's): a
    # cached prefix resumes it only where the tree keeps a snapshot of that state
    recurrent: bool = False
    lm_head: nn.Module  # the output projection (quantized with the weights when asked)
    graph_safe: bool  # whether a decode step may be captured as a CUDA graph
    vocab_widths: list[int]  # each rank's slice of the vocabulary, in rank order
    tied: bool  # lm_head shares the embedding's weights (the checkpoint has no lm_head)

    if TYPE_CHECKING:  # nn.Module's __call__ runs `forward` (through its hooks)

        def __call__(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor: ...

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, one row per new token (the same on every rank)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits of `hidden`'s rows."""
        raise NotImplementedError

    def load_weights(self, reader: WeightSource) -> None:
        """Every parameter (this rank's shard) from `reader`."""
        raise NotImplementedError

    def allocate_states(self, slots: int, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
        """Zeroed per-request state buffers for `slots` state slots (a batch names each
        request's: `ForwardBatch.state_slots`), a recurrence's in `ssm_dtype`; a slot's state
        is row `slot` of each (`state_pool.StatePool` copies, snapshots and stores them). None
        for a model without (`recurrent` off)."""
        return []

    def projections(self) -> dict[tuple[int, str], Projection]:
        """Each layer's adaptable linears by (layer, call site): "qkv", "o", "gate_up", "down"
        for an attention decoder. An architecture without any returns none, and LoRA is refused
        at start by its name."""
        return {}

    def keep_embedding_packed(self, weight: PackedGroups, lm_head: nn.Module | None) -> None:
        """Look tokens up in the packed `weight` from now on (`lm_head`: a tied output
        projection's module over the same groups)."""
        raise NotImplementedError
