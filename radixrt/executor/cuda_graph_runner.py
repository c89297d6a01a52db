"""Decode steps replayed from CUDA graphs (on by default on CUDA; `--disable-cuda-graph`).

A decode step of a small model is a few hundred kernel launches of a few microseconds each; from
Python, launching them costs more than running them. So at startup the decode forward is
captured once per batch size of `capture_sizes` into a CUDA graph, over static input buffers;
a step with B decodes copies its inputs into the buffers of the smallest captured size >= B,
pads the rest with dummy requests (one key each, in the reserved slot 0) and replays the graph.
Steps with extends, or more decodes than the largest size, run eagerly as before.

The graphs use the Triton decode kernel with a fixed number of KV splits (the eager path picks
it per step), so replayed and eager outputs agree to rounding, not bit for bit.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from radixrt.attention.triton_backend import MAX_KV_SPLITS, TritonAttentionBackend, TritonMetadata
from radixrt.forward_batch import ForwardBatch

CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def capture_sizes(max_running_requests: int) -> list[int]:
    """The captured batch sizes: those below the running limit, and the limit itself (at most
    the largest of CAPTURE_SIZES: bigger decode batches run eagerly)."""
    top = min(max_running_requests, CAPTURE_SIZES[-1])
    return [s for s in CAPTURE_SIZES if s < top] + [top]


class CudaGraphRunner:
    """Decode graphs of `model` over `attn` (the Triton backend), one per captured batch size,
    reading each request's slots from `req_to_token` (rows up to `context_length` + 1 long)."""

    def __init__(
        self,
        model: nn.Module,
        attn: TritonAttentionBackend,
        req_to_token: torch.Tensor,
        max_running_requests: int,
        context_length: int,
    ):
        self.model, self.attn, self.req_to_token = model, attn, req_to_token
        self.sizes = capture_sizes(max_running_requests)
        device, largest = req_to_token.device, self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.out_slots = torch.zeros(largest, dtype=torch.long, device=device)
        self.rows = torch.zeros(largest, dtype=torch.long, device=device)
        self.kv_indptr = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # every request's context at once, up to the longest a request can have
        self.kv_indices = torch.zeros(
            largest * (context_length + 1), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return len(batch.extend_lens) <= self.sizes[-1] and all(e == 1 for e in batch.extend_lens)

    def _batch(self, size: int) -> ForwardBatch:
        """The static buffers seen as a batch of `size` decodes."""
        meta = TritonMetadata(
            decode=True,
            qo_indptr=self.kv_indptr[: size + 1],  # unused by the decode kernel
            kv_indptr=self.kv_indptr[: size + 1],
            kv_indices=self.kv_indices,
            max_extend_len=1,
            num_kv_splits=MAX_KV_SPLITS,
        )
        return ForwardBatch(
            self.input_ids[:size],
            self.positions[:size],
            self.out_slots[:size],
            self.rows[:size],
            prefix_lens=[0] * size,
            extend_lens=[1] * size,
            attn_metadata=meta,
        )

    def _capture_all(self) -> None:
        """Largest first, all in one memory pool: smaller graphs reuse the largest's memory."""
        model, attn = self.model, self.attn
        pool = None
        for size in reversed(self.sizes):
            batch = self._batch(size)
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: Triton compiles, allocator settles
                for _ in range(2):
                    model(batch, attn)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model(batch, attn)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [B, H] of a decode batch. A view of the graph's output buffer: read it
        before the next replay."""
        b = len(batch.extend_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        seq_lens = torch.tensor(batch.seq_lens + [1] * (size - b), dtype=torch.int32)
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.out_slots[:b].copy_(batch.out_slots)
        self.out_slots[b:size].zero_()  # dummies write to the reserved slot 0 and read only it
        self.kv_indptr[1 : size + 1].copy_(seq_lens.cumsum(0, dtype=torch.int32))
        max_len = max(batch.seq_lens)
        table = self.req_to_token[batch.rows, :max_len]
        lens = seq_lens[:b].to(table.device)
        mask = torch.arange(max_len, device=table.device)[None, :] < lens[:, None]
        total = int(seq_lens[:b].sum())
        self.kv_indices[:total].copy_(table[mask])
        self.kv_indices[total : total + size - b].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:b]
