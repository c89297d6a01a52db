"""Which part of each sharded shape a tensor-parallel rank holds; arithmetic only, no torch.

Attention heads split by GQA group, so every rank's query heads share its KV heads evenly:
- N <= KV heads: the KV heads (with their query heads) are dealt out in contiguous runs whose
  sizes differ by at most one (3 KV heads over 2 ranks: 2 and 1);
- N > KV heads: each KV head is replicated on N / KV ranks, which split its query heads; this
  needs N to be a multiple of the KV heads and the group size a multiple of N / KV heads.
The MLP's intermediate size and the vocabulary split into contiguous, near-equal ranges.
"""

from __future__ import annotations

from typing import NamedTuple


class HeadShard(NamedTuple):
    """Query heads [q_start, q_end) and KV heads [kv_start, kv_end) of one rank."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def split_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share when n items are dealt out as evenly as possible."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """The heads `rank` of `size` holds; ValueError where the shapes cannot be split."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv_start, kv_end = split_range(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    replicas = size // num_kv_heads
    if size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tensor parallelism over {size} ranks cannot split {num_kv_heads} KV heads "
            f"({group} query heads each): the rank count must be at most the KV heads, or a "
            "multiple of them that divides each group's query heads"
        )
    kv = rank // replicas
    per_rank = group // replicas
    q_start = kv * group + (rank % replicas) * per_rank
    return HeadShard(q_start, q_start + per_rank, kv, kv + 1)
