"""`--quantization int8` against float32 on the same weights: not token-exact, so held to quality
gates on a fixed text shipped with the tests (teacher-forced, 500 positions): perplexity within
2% of float32's, and the top-1 token the same as float32's at >= 95% of the positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.config import ServerArgs
from radixrt.executor.model_runner import ModelRunner
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import int8_gemm
from radixrt.models.linear import Int8Linear

TEXT = Path(__file__).resolve().parent.parent / "data" / "quality_text.txt"
POSITIONS = 500

pytestmark = [
    pytest.mark.skipif(not int8_gemm.available(), reason="int8 needs AVX2 and a compiler"),
    pytest.mark.model,  # the default model
]


def _teacher_forced_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits [n, V] at every position of `ids`, in one prefill over slots 1..n."""
    n = len(ids)
    slots = torch.arange(1, n + 1)
    runner.req_to_token_pool.req_to_token[1, :n] = slots.to(torch.int32)
    positions = torch.arange(n)
    batch = ForwardBatch(torch.tensor(ids), positions, slots, torch.tensor([1]), [0], [n])
    return runner.logits(runner.forward(batch)).double()


def test_int8_weights_pass_the_quality_gates():
    runners = {
        q: ModelRunner(ServerArgs(max_total_tokens=1024, quantization=q).executor)
        for q in (None, "int8")
    }
    assert sum(isinstance(m, Int8Linear) for m in runners["int8"].model.modules()) == 4 * 30 + 1
    assert runners["int8"].weights.weight_bytes * 4 == runners[None].weights.weight_bytes
    ids = runners[None].tokenizer.encode(TEXT.read_text())[: POSITIONS + 1]
    assert len(ids) == POSITIONS + 1
    logits = {q: _teacher_forced_logits(r, ids)[:POSITIONS] for q, r in runners.items()}
    targets = torch.tensor(ids[1:])
    ppl = {
        q: float(torch.exp(-rows.log_softmax(-1).gather(1, targets[:, None]).mean()))
        for q, rows in logits.items()
    }
    agreement = float((logits["int8"].argmax(-1) == logits[None].argmax(-1)).double().mean())
    print(f"perplexity float32 {ppl[None]:.3f}, int8 {ppl['int8']:.3f}; top-1 {agreement:.3f}")
    assert abs(ppl["int8"] / ppl[None] - 1) <= 0.02
    assert agreement >= 0.95


def test_int8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int4")
    with pytest.raises(ValueError, match="int8"):
        ModelRunner(ServerArgs(device="meta", quantization="int8").executor)
