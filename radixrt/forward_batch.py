"""What one model step computes: a flattened ragged batch of new tokens over paged KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of every request, back to back
    positions: torch.Tensor  # [T] their positions in their sequences
    out_slots: torch.Tensor  # [T] KV slots the new tokens' K/V are written to
    rows: torch.Tensor  # [B] request-table rows
    prefix_lens: list[int]  # [B] tokens already in the pool before this step
    extend_lens: list[int]  # [B] new tokens this step (1 for a decode)
    attn_metadata: Any = None  # built once per step by the attention backend, shared by all layers
    lora_names: list[str] | None = None  # [B] each request's adapter ("" the base); None: none
    state_slots: torch.Tensor | None = None  # [B] a recurrent model's state slot of each request

    @property
    def has_adapters(self) -> bool:
        return self.lora_names is not None and any(self.lora_names)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
