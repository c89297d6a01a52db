"""GGUF files made by llama.cpp's own quantizer (`llama-quantize`, built by `make test` outside
the checkout) served packed at the defaults, against llama.cpp's own server on the same file:
llama.cpp's greedy next token at each position of a natural text (teacher-forced through
`llama-server`, its prompt cache reused) against the token radixrt's packed weights predict
there. The default model (SmolLM2-135M, Q4_1) requantized by llama-quantize: its width (576) is
not a multiple of 256, so llama.cpp's Q4_K_M, Q5_K_M, Q3_K_S and IQ4_XS mixes take
Q4_K/Q5_K/Q3_K/IQ4_XS only where they fit and fall back to Q5_0/Q5_1/Q4_0/IQ4_NL elsewhere, with
Q6_K and Q8_0 beside them, as a Hub file of such a model holds: every type radixrt packs but
Q4_1 (the file itself, `test_quantization`) and Q2_K (whose mixes fall back to Q3_K and Q4_0
here; `test_gguf_weights` holds its blocks to gguf's, and the last test a file of it). Every
linear is served packed (no float copy); the gates: top-1 agreement >= 0.9 over 120 positions
(measured 0.92 for Q3_K_S, its Q3_K down projections in 3-bit groups, 0.95 to 0.97 for the
others; radixrt's float32 reading of the same files agrees 0.94 to 0.97: llama.cpp's own
numerics, f16 KV and 8-bit activations, differ).

Q3_K and Q2_K at their own widths (`int4_gemm.SUB_SCALED`): a 256-wide random Llama (where
K-quants fit every linear) converted by llama.cpp's converter and requantized to Q3_K_M and
Q2_K, served at the defaults: the reason names the widths, the packed linears hold about the
file's bytes, and the tokens are the file's float32 reading's.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.bench.peers import LlamaServerTarget, llama_cpp_tool
from radixrt.config import ServerArgs
from radixrt.executor import gguf_file
from radixrt.executor.model_loader import default_gguf_path
from radixrt.executor.model_runner import ModelRunner, linear_bytes
from radixrt.kernels import int4_gemm
from radixrt.kernels.int4_gemm import Bits
from radixrt.models.layers import PackedEmbedding
from radixrt.models.linear import GroupedLinear

from helpers import QUALITY_TEXT, TINY, make_scheduler, requests_in_process, teacher_forced_logits

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


CONVERTER = Path(os.environ.get("RADIXRT_LLAMA_CPP_CONVERTER", "/nonexistent"))
# llama-quantize's type -> its file's widths (the linears', the table's) and the bounds of the
# packed linears' and table's bytes over the file's (measured 1.11 and 1.16: Q3_K at 4 bits a
# weight, Q2_K at 3.5, qkv stacking a Q5_K or Q3_K v in 8-bit groups, the Q6_K output projection
# at 7; a Q3_K tensor in 6-bit groups took 2.0 times its bytes, a Q2_K one in 8-bit groups 3.2)
SUB_SCALED_FILES = {
    "Q3_K_M": ({Bits.INT3, Bits.INT4, Bits.INT8, Bits.INT6}, Bits.INT3, (1.05, 1.15)),
    "Q2_K": ({Bits.INT2, Bits.INT3, Bits.INT8, Bits.INT6}, Bits.INT2, (1.1, 1.2)),
}


@pytest.fixture(scope="module")
def sub_scaled_files(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """llama-quantize's type -> its file of a 256-wide random Llama (the converter's f16,
    requantized)."""
    root = tmp_path_factory.mktemp("sub-scaled")
    folder = root / "llama"
    shape = {**TINY, "hidden_size": 256, "intermediate_size": 512}
    config = AutoConfig.for_model("llama", **shape, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # its own folder's imports
    f16 = root / "llama.f16.gguf"
    subprocess.run(
        [sys.executable, "convert_hf_to_gguf.py", str(folder), "--outtype", "f16"]
        + ["--outfile", str(f16)],
        cwd=CONVERTER,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    made = {}
    for kind in SUB_SCALED_FILES:
        made[kind] = root / f"llama.{kind}.gguf"
        command = [str(QUANTIZE), str(f16), str(made[kind]), kind, "2"]
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    return made


@pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's converter: `make test` fetches it (RADIXRT_LLAMA_CPP_CONVERTER)",
)
@pytest.mark.parametrize("kind", list(SUB_SCALED_FILES))
def test_q3_k_and_q2_k_files_are_served_at_their_own_widths(sub_scaled_files, kind):
    """At the defaults: every linear packed, Q3_K's (and Q2_K's) alone in their own widths, the
    table too, the reason naming them; the linears' bytes within the measured ratio of the
    file's; each linear's outputs within 1% of the same file's at `--quantization none` (its
    float32 reading: the same weights, so only the 8-bit activations differ; a random model's
    flat logits make its tokens no gate); a row's greedy tokens and logprobs the same alone and
    in a batch, on the one-call decode and the per-op path."""
    path = sub_scaled_files[kind]
    widths, table_width, (low, high) = SUB_SCALED_FILES[kind]
    scheduler = make_scheduler(path, max_total_tokens=1024)
    runner = scheduler.runner
    floats = dict(make_scheduler(path, quantization="none").runner.model.named_modules())
    assert runner.quant.name == "gguf", runner.quant.reason
    own = {"Q3_K": "3-bit"} if kind == "Q3_K_M" else {"Q2_K": "2-bit", "Q3_K": "3-bit"}
    for name, width in own.items():
        assert f"{name} in {width} groups" in runner.quant.reason, runner.quant.reason
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * TINY["num_hidden_layers"] + 1  # qkv, o, gate_up, down; the head
    assert {m.weight.bits for m in linears} == widths
    table = runner.model.embed_tokens
    assert isinstance(table, PackedEmbedding) and table.weight.bits == table_width
    held = gguf_file.read(path).tensors
    stored = sum(t.n_bytes for t in held.values() if t.kind.name != "F32")
    ratio = (linear_bytes(runner.model) + table.weight.nbytes) / stored
    print(f"{kind}: packed bytes over the file's {ratio:.3f}")
    assert low <= ratio <= high, ratio
    gen = torch.Generator().manual_seed(0)
    for name, module in runner.model.named_modules():
        if isinstance(module, GroupedLinear):
            x = torch.randn(4, module.weight.in_features, generator=gen)
            want = floats[name](x)
            assert (module(x) - want).norm() <= 0.01 * want.norm(), name
    random.seed(0)
    prompts = [[random.randrange(TINY["vocab_size"]) for _ in range(3 + 5 * i)] for i in range(6)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True}

    def run(batches: list[list[list[int]]]) -> list:
        done = requests_in_process(scheduler, batches, params)
        return [(r.output_ids, r.output_token_logprobs) for r in done]

    together = run([prompts])
    assert runner.model._fused is not None  # the decode steps ran in one native call
    assert run([[p] for p in prompts]) == together
    runner.model._fused, runner.model._fused_checked = None, True  # the per-op path from here on
    assert run([prompts]) == together
