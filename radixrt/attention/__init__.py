"""Attention backends: they attend over the paged pool, into which the model has written the
step's new K/V."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from radixrt.forward_batch import ForwardBatch

if TYPE_CHECKING:  # types only: the pools' owners import this package, not the reverse
    from radixrt.mem_cache.memory_pool import TokenToKVPool


class AttentionBackend(Protocol):
    kv_pool: TokenToKVPool

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build index/mask metadata once per step into `batch.attn_metadata`."""

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D] of the new tokens -> attention output [T, Hq, D]. The caller has already
        stored the new tokens' K/V in the pool at `batch.out_slots` (`kv_pool.set_kv`, or a fused
        kernel); k/v [T, Hkv, D] are those same values where the caller still has them, else
        None."""


def create_backend(
    name: str,
    device: torch.device,
    req_to_token: torch.Tensor,
    kv_pool: TokenToKVPool,
    windows: tuple[int | None, ...] = (),
    logit_cap: float | None = None,
    deterministic: bool = False,
    rows_exact: bool = False,
) -> AttentionBackend:
    """The backend `name` over the pool; `windows` gives each layer's sliding window (None:
    global; empty: every layer global), which the backend attends only within; with
    `logit_cap` every score s is soft-capped to cap * tanh(s / cap) before the softmax;
    `deterministic`: every query row reduced in one fixed order
    (`--enable-deterministic-inference`); `rows_exact`: that order for the steps with prompt
    rows, where the CPU's in-place kernel runs, for linears whose rows are computed alone
    (grouped 4/8-bit)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from radixrt.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(
            req_to_token, kv_pool, windows, logit_cap, deterministic, rows_exact
        )
    if name == "triton":
        from radixrt.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(req_to_token, kv_pool, windows, logit_cap, deterministic)
    raise ValueError(f"unknown attention backend {name!r}")
