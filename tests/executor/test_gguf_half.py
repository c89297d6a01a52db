"""A GGUF's F16 and BF16 linears served at their own width (`int4_gemm`'s 16-bit widths, 2 bytes a
weight), not dequantized to float32:

- files llama.cpp's converter makes (`--outtype f16` and `bf16`, from the tiny random Llama the
  other GGUF tests convert) at the defaults: every linear, the output projection and the
  embedding table held at 16 bits (model_info's reason says so), half the bytes of the same
  file at `--quantization none`, greedy tokens equal to it and teacher-forced logits within
  float32's summation order; a row's tokens and logprobs the same alone and in a batch of 8,
  through the one-call decode (`cpu_layer`) and the per-op path alike;
- files written with gguf's writer: F16 and BF16 tensors beside quantized and float32 ones,
  which the plan stacks only with their own type, and not under `int4` or on a GPU.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from radixrt.executor import gguf_weights
from radixrt.executor.model_runner import linear_bytes
from radixrt.executor.quant_choice import Ground, choose
from radixrt.kernels import cpu_isa, int4_gemm
from radixrt.kernels.int4_gemm import Bits
from radixrt.models.layers import PackedEmbedding
from radixrt.models.linear import GroupedLinear

from helpers import (
    TINY,
    make_scheduler,
    requests_in_process,
    teacher_forced_logits,
    write_random_gguf,
)

CONVERTER = Path(os.environ.get("RADIXRT_LLAMA_CPP_CONVERTER", "/nonexistent"))
needs_converter = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's converter: `make test` fetches it (RADIXRT_LLAMA_CPP_CONVERTER)",
)
pytestmark = pytest.mark.skipif(
    not int4_gemm.available(), reason="16-bit GGUF linears need AVX2 and a compiler"
)
WIDTHS = {"f16": Bits.F16, "bf16": Bits.BF16}  # the converter's outtype -> the width served
PROMPTS = [[1, 504, 3000, 42, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def files(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """outtype -> the GGUF llama.cpp's converter made of a tiny random Llama at it."""
    root = tmp_path_factory.mktemp("half")
    folder = root / "llama"
    config = AutoConfig.for_model("llama", **TINY, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # its own folder's imports
    made = {}
    for outtype in WIDTHS:
        made[outtype] = root / f"llama.{outtype}.gguf"
        subprocess.run(
            [sys.executable, "convert_hf_to_gguf.py", str(folder), "--outtype", outtype]
            + ["--outfile", str(made[outtype])],
            cwd=CONVERTER,
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
    return made


@needs_converter
@pytest.mark.parametrize("outtype", list(WIDTHS))
def test_a_16_bit_file_is_served_at_16_bits_as_its_float_reading(files, outtype):
    """Every linear and the table at the file's width, the reason naming it; the linears' and
    the table's bytes half of float32's; 64 teacher-forced positions against the same file at
    `--quantization none` (its float32 dequantization: the same weights, so only float32's
    summation order differs): top-1 agreement >= 0.99, logits within 1e-4 relative; greedy
    tokens equal."""
    gguf_path, width = files[outtype], WIDTHS[outtype]
    random.seed(0)
    ids = [random.randrange(TINY["vocab_size"]) for _ in range(64)]
    served = {}
    for quantization in ("auto", "none"):
        scheduler = make_scheduler(gguf_path, quantization=quantization, max_total_tokens=256)
        runner = scheduler.runner
        logits = teacher_forced_logits(runner, ids)  # before the scheduler takes slots
        served[quantization] = runner, logits, requests_in_process(scheduler, [PROMPTS], GREEDY)
    (half, packed, ours), (dense, floats, theirs) = served["auto"], served["none"]
    assert half.quant.name == "gguf" and f"{outtype.upper()} at 16 bits" in half.quant.reason
    linears = [m for m in half.model.modules() if isinstance(m, GroupedLinear)]
    assert len(linears) == 4 * TINY["num_hidden_layers"] + 1  # qkv, o, gate_up, down; the head
    assert {m.weight.bits for m in linears} == {width}
    table = half.model.embed_tokens
    assert isinstance(table, PackedEmbedding) and table.weight.bits == width
    ratio = linear_bytes(half.model) / linear_bytes(dense.model)
    assert 0.49 <= ratio <= 0.51, ratio
    assert table.weight.nbytes * 2 == dense.model.embed_tokens.weight.nbytes
    agreement = (packed.argmax(-1) == floats.argmax(-1)).double().mean().item()
    error = ((packed - floats).norm(dim=-1) / floats.norm(dim=-1)).max().item()
    assert agreement >= 0.99 and error <= 1e-4, (agreement, error)
    assert [r.output_ids for r in ours] == [r.output_ids for r in theirs]


@needs_converter
def test_a_rows_tokens_and_logprobs_do_not_depend_on_its_batch(files):
    """Eight prompts of different lengths decoded together, then each alone (its prompt from
    the cache but its last token), then together on the per-op path: the same tokens and
    logprobs, bit for bit (16-bit linears sum each row alone; the one-call decode runs the
    same kernel body)."""
    scheduler = make_scheduler(files["f16"], max_total_tokens=1024)
    random.seed(2)
    prompts = [[random.randrange(TINY["vocab_size"]) for _ in range(3 + 5 * i)] for i in range(8)]
    params = {**GREEDY, "max_new_tokens": 8, "return_logprob": True}

    def run(batches: list[list[list[int]]]) -> list:
        done = requests_in_process(scheduler, batches, params)
        return [(r.output_ids, r.output_token_logprobs) for r in done]

    together = run([prompts])
    model = scheduler.runner.model
    assert model._fused is not None  # the decode steps ran in one native call
    assert run([[p] for p in prompts]) == together
    model._fused, model._fused_checked = None, True  # the per-op path from here on
    assert run([prompts]) == together


K = 64
CONFIG = LlamaConfig(
    hidden_size=K, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
)
# name -> (rows, type): q/k/v all F16 (stacked, q and k rows put back in Hugging Face's order),
# o BF16, gate F16 beside a Q8_0 up (no common width: float), down Q8_0, the table F16 and the
# output projection F32 (float)
TENSORS = {
    "blk.0.attn_q.weight": (K, T.F16),
    "blk.0.attn_k.weight": (32, T.F16),
    "blk.0.attn_v.weight": (32, T.F16),
    "blk.0.attn_output.weight": (K, T.BF16),
    "blk.0.ffn_gate.weight": (40, T.F16),
    "blk.0.ffn_up.weight": (40, T.Q8_0),
    "blk.0.ffn_down.weight": (K, T.Q8_0),
    "token_embd.weight": (50, T.F16),
    "output.weight": (50, T.F32),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A llama GGUF of TENSORS (random weights) and gguf's float32 reading of each."""
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    write_random_gguf(path, TENSORS, K)
    floats = {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        for t in gguf.GGUFReader(path).tensors
    }
    return path, floats


def test_16_bit_tensors_stack_only_with_their_own_type(written, tmp_path):
    """q/k/v (F16), o (BF16) and the table (F16) are planned at their widths, equal to gguf's
    float reading; gate/up (F16 beside Q8_0) and the F32 head stay float; the packed copy reads
    back the same panels (no scales: empty tensors)."""
    path, floats = written
    plan = gguf_weights.plan(path, CONFIG)
    qkv, o = "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"
    assert set(plan.linears) == {qkv, o, "layers.0.mlp.down_proj", "embed_tokens"}
    cache = gguf_weights.packed_cache(tmp_path)
    linears = gguf_weights.read_linears(plan, cache)
    assert (linears[qkv].bits, linears[o].bits) == (Bits.F16, Bits.BF16)
    q = floats["blk.0.attn_q.weight"][gguf_weights._unpermute(K, 4)]
    k = floats["blk.0.attn_k.weight"][gguf_weights._unpermute(32, 2)]
    assert torch.equal(linears[qkv].dequantize(), torch.cat([q, k, floats["blk.0.attn_v.weight"]]))
    assert torch.equal(linears[o].dequantize(), floats["blk.0.attn_output.weight"])
    assert torch.equal(linears["embed_tokens"].dequantize(), floats["token_embd.weight"])
    for name, weight in gguf_weights.read_linears(plan, cache).items():
        assert torch.equal(weight.tiles, linears[name].tiles) and weight.bits == linears[name].bits


def test_int4_and_a_gpu_take_no_16_bit_linears(written):
    """`int4` quantizes the 16-bit linears from float; a GPU serves them float (16-bit in its
    dtype already), and names no 16-bit type where it finds nothing to pack."""
    path, _ = written
    ground = dict(
        model_arg=str(path),
        source=path,
        compute_device=torch.device("cpu"),
        isa=cpu_isa.resolve("auto", cpu_isa.host_paths()),
        tp_size=1,
        deterministic=False,
        prequantized=False,
    )
    on_cpu = choose("gguf", Ground(**ground), CONFIG)
    assert on_cpu.reason == "--quantization gguf (Q8_0 packed; BF16/F16 at 16 bits a weight)"
    for chosen in (
        choose("int4", Ground(**ground), CONFIG),
        choose(
            "gguf",
            Ground(**{**ground, "compute_device": torch.device("cuda"), "isa": None}),
            CONFIG,
        ),
    ):
        assert chosen.plan is not None
        assert set(chosen.plan.linears) == {"layers.0.mlp.down_proj"}  # the Q8_0 one alone
