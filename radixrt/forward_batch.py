"""What one model step computes: a flattened ragged batch of new tokens over paged KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class ImagePart:
    """A run of a step's new tokens that are placeholders of one image: the batch's rows
    [row, row + count) take rows [first, first + count) of the features of the image whose
    content key is `key` (`picture`: the image decoded, preprocessed and encoded only where the
    runner has no features of that key yet)."""

    row: int
    key: str
    picture: Image.Image
    first: int
    count: int


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
    # the image placeholders among the new tokens (the scheduler's), and what the model writes
    # over their embeddings (the runner's, from `images`): (first row, [rows, hidden] features)
    images: list[ImagePart] | None = None
    image_embeds: list[tuple[int, torch.Tensor]] | None = None

    @property
    def has_adapters(self) -> bool:
        return self.lora_names is not None and any(self.lora_names)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
