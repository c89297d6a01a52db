"""What rank 0 tells the other tensor-parallel ranks each step, and how it is encoded.

A command is a msgpack header (`"op"` names it) and, for a forward, one int64 CPU payload
(`TPGroup.send` / `TPGroup.recv` carry both; never pickle). Rank 0 runs the scheduler and owns
the request->token table; the others keep theirs in step from what each forward sends.
"""

from __future__ import annotations

from typing import Any

import torch

from radixrt.forward_batch import ForwardBatch

FORWARD, LOGITS, HEARTBEAT, SHUTDOWN = "forward", "logits", "heartbeat", "shutdown"
LOAD_LORA, UNLOAD_LORA = "load_lora", "unload_lora"  # header: name (and path to load)
UPDATE_WEIGHTS = "update_weights"  # header: path (a safetensors folder) and checkpoint (bool)
RELEASE_KV, RESUME_KV = "release_kv", "resume_kv"  # the KV pool's memory freed, and back


def encode_forward(
    batch: ForwardBatch, req_to_token: torch.Tensor
) -> tuple[dict[str, Any], torch.Tensor]:
    """Rank 0: a forward's header and payload: ids, positions, slots, rows, and each row's slot
    list up to its new tokens (the other ranks' request->token tables follow rank 0's); the
    header names each request's adapter."""
    rows = batch.rows.tolist()
    table = [req_to_token[r, :n].long() for r, n in zip(rows, batch.seq_lens)]
    payload = torch.cat(
        [t.cpu() for t in (batch.input_ids, batch.positions, batch.out_slots, batch.rows, *table)]
    )
    return {
        "op": FORWARD,
        "prefix_lens": batch.prefix_lens,
        "extend_lens": batch.extend_lens,
        "lora_names": batch.lora_names,
    }, payload


def decode_forward(
    header: dict[str, Any], payload: torch.Tensor, req_to_token: torch.Tensor
) -> ForwardBatch:
    """The other ranks: the batch rank 0 sent (on `req_to_token`'s device), its rows' slot
    lists written into this rank's request->token table."""
    device = req_to_token.device
    prefix, extend = header["prefix_lens"], header["extend_lens"]
    seq = [p + e for p, e in zip(prefix, extend)]
    t, b = sum(extend), len(prefix)
    ids, positions, slots, rows, table = torch.split(payload, [t, t, t, b, sum(seq)])
    for row, part in zip(rows.tolist(), torch.split(table, seq)):
        req_to_token[row, : len(part)] = part.to(device=device, dtype=req_to_token.dtype)
    return ForwardBatch(
        input_ids=ids.to(device),
        positions=positions.to(device),
        out_slots=slots.to(device),
        rows=rows.to(device),
        prefix_lens=list(prefix),
        extend_lens=list(extend),
        lora_names=header.get("lora_names"),
    )


def logits_header(rows: int) -> dict[str, Any]:
    """Rank 0: a logits call over `rows` hidden rows (broadcast right after the header)."""
    return {"op": LOGITS, "rows": rows}
