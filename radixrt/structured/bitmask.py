"""Token masks of a batch: one int32 row per request (bit j of word i = token 32*i + j), turned
into -inf logits in one pass (a C kernel for float32 CPU logits, `kernels/cpu_mask.py`) or one
batched torch op."""

from __future__ import annotations

import torch

from radixrt.kernels import cpu_mask


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A zeroed (nothing allowed) int32 CPU bitmask of shape [batch, ceil(vocab_size / 32)]."""
    return torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> None:
    """In place, set logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in `rows` (every row
    if None). Bitmask rows line up with logits rows; logits columns beyond the bitmask are masked too."""
    if rows is not None and not rows:
        return
    if cpu_mask.apply_bitmask(logits, bitmask, rows):
        return
    device = logits.device
    if device not in _BIT_VALUES:
        # 1 << 31 as int32 is the sign bit: exactly the bit pattern wanted.
        _BIT_VALUES[device] = torch.tensor(
            [1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device
        )
    if rows is not None:
        bitmask = bitmask[rows]
    words = bitmask.to(device)
    vocab = logits.shape[1]
    covered = min(vocab, 32 * words.shape[1])
    disallowed = (
        (words.unsqueeze(-1) & _BIT_VALUES[device]).eq(0).view(words.shape[0], -1)[:, :covered]
    )
    if rows is None:
        target = logits
    else:
        index = torch.tensor(rows, device=device)
        target = logits.index_select(0, index)
    target[:, :covered].masked_fill_(disallowed, float("-inf"))
    if covered < vocab:
        target[:, covered:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, index, target)
