"""The forward command rank 0 sends the other ranks: what it decodes to is the batch it encoded,
and the receiving rank's request->token table gets the batch rows' slot lists (model-free)."""

from __future__ import annotations

import msgpack
import torch

from radixrt.distributed.commands import FORWARD, decode_forward, encode_forward
from radixrt.forward_batch import ForwardBatch


def test_a_forward_decodes_to_the_batch_it_encoded():
    sender = torch.zeros(4, 16, dtype=torch.int32)
    sender[1, :5] = torch.arange(10, 15)  # a request 3 tokens in, extending by 2
    sender[3, :1] = torch.tensor([7])  # a new request's first token
    batch = ForwardBatch(
        input_ids=torch.tensor([101, 102, 103]),
        positions=torch.tensor([3, 4, 0]),
        out_slots=torch.tensor([13, 14, 7]),
        rows=torch.tensor([1, 3]),
        prefix_lens=[3, 0],
        extend_lens=[2, 1],
    )
    header, payload = encode_forward(batch, sender)
    assert header["op"] == FORWARD
    header = msgpack.unpackb(msgpack.packb(header))  # as it travels
    receiver = torch.full((4, 16), -1, dtype=torch.int32)
    got = decode_forward(header, payload.to(torch.int64), receiver)
    for name in ("input_ids", "positions", "out_slots", "rows"):
        assert getattr(got, name).tolist() == getattr(batch, name).tolist(), name
    assert (got.prefix_lens, got.extend_lens) == (batch.prefix_lens, batch.extend_lens)
    assert receiver[1, :5].tolist() == sender[1, :5].tolist()
    assert receiver[3, :1].tolist() == [7]
    assert (receiver[[0, 2]] == -1).all()  # rows not in the batch are left alone
