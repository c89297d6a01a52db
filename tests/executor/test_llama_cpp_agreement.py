"""GGUF files made by llama.cpp's own quantizer (`llama-quantize`, built by `make test` outside
the checkout) served packed at the defaults, against llama.cpp's own server on the same file:
llama.cpp's greedy next token at each position of a natural text (teacher-forced through
`llama-server`, its prompt cache reused) against the token radixrt's packed weights predict
there. The default model (SmolLM2-135M, Q4_1) requantized by llama-quantize: its width (576) is
not a multiple of 256, so llama.cpp's Q4_K_M, Q5_K_M, Q3_K_S and IQ4_XS mixes take
Q4_K/Q5_K/Q3_K/IQ4_XS only where they fit and fall back to Q5_0/Q5_1/Q4_0/IQ4_NL elsewhere, with
Q6_K and Q8_0 beside them, as a Hub file of such a model holds: every type radixrt packs but
Q4_1 (the file itself, `test_quantization`) and Q2_K (whose mixes fall back to Q3_K and Q4_0
here; `test_gguf_weights` holds its blocks to gguf's). Every linear is served packed (no float
copy); the gates: top-1 agreement >= 0.9 over 120 positions (measured 0.92 for Q3_K_S, 0.95 to
0.97 for the others; radixrt's float32 reading of the same files agrees 0.94 to 0.97:
llama.cpp's own numerics, f16 KV and 8-bit activations, differ).
"""

from __future__ import annotations

import subprocess

import pytest

from radixrt.bench.peers import LlamaServerTarget, llama_cpp_tool
from radixrt.config import ServerArgs
from radixrt.executor import gguf_file
from radixrt.executor.model_loader import default_gguf_path
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import int4_gemm
from radixrt.models.linear import GroupedLinear

from helpers import QUALITY_TEXT, teacher_forced_logits

QUANTIZE, SERVER = llama_cpp_tool("llama-quantize"), llama_cpp_tool("llama-server")
pytestmark = [
    pytest.mark.skipif(
        QUANTIZE is None or SERVER is None, reason="llama.cpp's tools: `make test` builds them"
    ),
    pytest.mark.skipif(not int4_gemm.available(), reason="packed GGUF needs AVX2 and a compiler"),
    pytest.mark.model,
]
POSITIONS = 120
# llama-quantize's type -> the GGUF types its file of the default model holds
TYPES = {
    "Q4_0": {"Q4_0", "Q8_0"},
    "Q4_K_M": {"Q4_K", "Q5_0", "Q6_K", "Q8_0"},
    "Q5_K_M": {"Q5_K", "Q5_1", "Q6_K", "Q8_0"},
    "Q6_K": {"Q6_K", "Q8_0"},
    "Q3_K_S": {"Q3_K", "Q4_0", "Q8_0"},  # Q3_K only where 256 fits: the down projections
    "IQ4_XS": {"IQ4_XS", "IQ4_NL", "Q5_K", "Q8_0"},
}


@pytest.mark.parametrize("kind", list(TYPES))
def test_llama_quantizes_files_predict_llama_cpps_tokens(kind, tmp_path):
    path = tmp_path / f"{kind}.gguf"
    subprocess.run(
        [str(QUANTIZE), "--allow-requantize", str(default_gguf_path()), str(path), kind, "2"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    stored = {t.kind.name for t in gguf_file.read(path).tensors.values()} - {"F32"}
    assert stored == TYPES[kind]
    args = {"model": str(path), "attention_backend": "torch", "max_total_tokens": 512}
    runner = ModelRunner(ServerArgs(**args).executor)
    assert runner.quant.name == "gguf", runner.quant.reason
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * runner.config.num_hidden_layers + 1  # qkv, o, gate_up, down; head
    ids = runner.tokenizer.encode(QUALITY_TEXT.read_text())[: POSITIONS + 8]
    ours = teacher_forced_logits(runner, ids)[7:-1].argmax(-1).tolist()
    server = LlamaServerTarget(SERVER, path, slots=1, context_length=512)
    try:
        theirs = [server.next_token(ids[:n]) for n in range(8, len(ids))]
    finally:
        server.close()
    agreement = sum(a == b for a, b in zip(ours, theirs)) / len(theirs)
    print(f"{kind}: top-1 agreement with llama.cpp {agreement:.3f}")
    assert agreement >= 0.9
