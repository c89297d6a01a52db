"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py, from the sources the
llama-cpp-python sdist vendors: `make test` fetches it) from tiny random checkpoints of each
family, served read in place: config and tensors from the file, no float copy on disk.

- float32 files (`--outtype f32`) at `--quantization none`: greedy tokens equal transformers'
  float32 on the checkpoint the file was made from, token for token;
- Q8_0 files (`--outtype q8_0`) at the defaults: served packed as stored (every family radixrt
  serves, not only llama and qwen2), held to the quality gates against the same file dequantized
  (teacher-forced top-1 agreement and logits' relative error);
- the hybrid families' files (LFM2's short convolutions, Qwen3.5's and Qwen3-Next's Gated
  DeltaNet, Granite 4's and Falcon-H1's Mamba-2) and the mixtures of experts', float and Q8_0,
  against llama.cpp's own server on the same file (teacher-forced greedy tokens);
- mutated copies of a converted file, a Llama's or a hybrid's (header, metadata, tensor
  table): each is served or refused in one line, in bounded time and memory, the whole start
  path included.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.bench.peers import LlamaServerTarget, llama_cpp_tool
from radixrt.config import ServerArgs
from radixrt.executor import gguf_file
from radixrt.executor.model_loader import conversion_folder
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import int4_gemm

from helpers import (
    TINY,
    hf_greedy,
    make_scheduler,
    mutated_header,
    requests_in_process,
    run_in_process,
    teacher_forced_logits,
)

CONVERTER = Path(os.environ.get("RADIXRT_LLAMA_CPP_CONVERTER", "/nonexistent"))
pytestmark = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's converter: `make test` fetches it (RADIXRT_LLAMA_CPP_CONVERTER)",
)
# a family's name here (its transformers model type, or `MODEL_TYPES`') -> what its tiny
# checkpoint needs beyond TINY (a head width that is not the width over the heads, as Qwen3 and
# Gemma 3 have)
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen3": {"head_dim": 32},
    "gemma3_text": {"head_dim": 32},
    # a short convolution, then attention: its state per request as from a safetensors folder
    "lfm2": {"layer_types": ["conv", "full_attention"], "conv_L_cache": 3},
    # a Gated DeltaNet (4 value heads over 2 key heads, which the converter tiles), then gated
    # attention rotating whole heads of 64 (llama.cpp's M-RoPE sections take 32 rotated pairs)
    "qwen3_5_text": {
        "layer_types": ["linear_attention", "full_attention"],
        "head_dim": 64,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 1.0,
        },
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    },
}
# experts (each a matrix of llama.cpp's tensor of every expert's), their top k renormalised as
# llama.cpp always does for Qwen3-MoE (so do the Hub's checkpoints)
EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
}
FAMILIES["qwen3_moe"] = {"head_dim": 32, **EXPERTS}
FAMILIES["qwen3_5_moe_text"] = {
    **FAMILIES["qwen3_5_text"],
    **EXPERTS,
    "shared_expert_intermediate_size": 96,
}
# Granite 4's -h shape, dense: a Mamba-2 layer, then attention without positions, its scalars
FAMILIES["granitemoehybrid"] = {
    "layer_types": ["mamba", "attention"],
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_chunk_size": 8,
    "shared_intermediate_size": TINY["intermediate_size"],
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "position_embedding_type": "nope",
    "embedding_multiplier": 3.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 2.5,
}
# Granite 4's -h-tiny shape: the same layers, four experts (two per token) beside the shared MLP
FAMILIES["granitemoehybrid_experts"] = {
    **FAMILIES["granitemoehybrid"],
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
}
# Qwen3-Next: a Gated DeltaNet (4 value heads over 2 key heads, grouped by key head in its fused
# projections), then gated attention rotating a quarter of each head; experts and a shared
# expert on every layer
FAMILIES["qwen3_next"] = {
    **{k: v for k, v in FAMILIES["qwen3_5_text"].items() if k != "rope_parameters"},
    **EXPERTS,
    "shared_expert_intermediate_size": 96,
}
# Falcon-H1: attention and Mamba-2 side by side on every layer (8 Mamba heads of 12), every
# multiplier other than 1 (the converter folds them into the tensors), the gated norm after the
# gate (where llama.cpp applies it)
FAMILIES["falcon_h1"] = {
    "head_dim": 16,
    "mamba_d_ssm": 96,
    "mamba_n_heads": 8,
    "mamba_d_head": 12,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_chunk_size": 8,
    "mamba_rms_norm": True,
    "mamba_norm_before_gate": False,
    "embedding_multiplier": 4.0,
    "lm_head_multiplier": 0.6,
    "mlp_multipliers": [0.7, 1.3],
    "key_multiplier": 0.5,
    "attention_in_multiplier": 0.9,
    "attention_out_multiplier": 1.2,
    "ssm_in_multiplier": 1.1,
    "ssm_out_multiplier": 0.1,
    "ssm_multipliers": [0.8, 1.25, 0.9, 1.1, 0.5],
}
MODEL_TYPES = {"granitemoehybrid_experts": "granitemoehybrid"}
MAMBA = ("granitemoehybrid", "granitemoehybrid_experts", "falcon_h1")  # Mamba-2 layers
# their files against llama.cpp's own server
AGAINST_LLAMA_CPP = (
    "lfm2",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    *MAMBA,
)
SERVER = llama_cpp_tool("llama-server")
PACKED = ("llama", "qwen3", "gemma3_text", *AGAINST_LLAMA_CPP)  # Q8_0 files served packed
# a checkpoint without the MTP head
CONVERTER_FLAGS = {n: "--no-mtp" for n in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")}
# the converter reads a copy of the checkpoint with these config fields changed, as the Hub's
# checkpoints hold them: transformers loads a Qwen3.5-MoE checkpoint's tokenizer as its own
# class, whose split of the test's (SmolLM2's) vocabulary llama.cpp's converter does not
# recognise (a real Qwen3.5's it does), so the copy names the dense model type for the
# tokenizer; transformers saves Granite 4's layer types by its own names, the converter reads
# the Hub's ("mamba", "attention")
CONVERTED_AS = {
    "qwen3_5_moe_text": {"model_type": "qwen3_5_text"},
    **{
        name: {"layer_types": FAMILIES[name]["layer_types"]}
        for name in ("granitemoehybrid", "granitemoehybrid_experts")
    },
}
PROMPTS = [[1, 504, 3000, 42, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# a line's worth of a driver: the converter once per (checkpoint, type, flags), imports paid once
# (the converter's folder on the path for its `conversion` package: PYTHONSAFEPATH leaves it off)
DRIVER = """
import runpy, sys
sys.path.insert(0, ".")
for folder, outtype, outfile, flags in zip(*[iter(sys.argv[1:])] * 4):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile]
    sys.argv += flags.split()
    try:
        runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory, default_model_dir) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(family, outtype) -> (the checkpoint, the GGUF llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("families")
    jobs = []
    made = {}
    for model_type, extra in FAMILIES.items():
        folder = root / model_type
        shape = {**TINY, "max_position_embeddings": 256, **extra}
        config = AutoConfig.for_model(MODEL_TYPES.get(model_type, model_type), **shape)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir / name, folder / name)
        source = folder
        if model_type in CONVERTED_AS:
            source = root / f"{model_type}-for-the-converter"
            shutil.copytree(folder, source)
            values = json.loads((source / "config.json").read_text())
            (source / "config.json").write_text(json.dumps({**values, **CONVERTED_AS[model_type]}))
        for outtype in ("f32", "q8_0") if model_type in PACKED else ("f32",):
            out = root / f"{model_type}.{outtype}.gguf"
            jobs += [str(source), outtype, str(out), CONVERTER_FLAGS.get(model_type, "")]
            made[model_type, outtype] = (folder, out)
    subprocess.run(
        [sys.executable, "-c", DRIVER, *jobs],
        cwd=CONVERTER,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return made


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_converted_float_file_is_exact_against_transformers(files, model_type, tmp_path):
    folder, gguf = files[model_type, "f32"]
    scheduler = make_scheduler(gguf, quantization="none")
    assert scheduler.runner.quant.name is None
    got = run_in_process(scheduler, [PROMPTS], GREEDY)
    assert got == hf_greedy(folder, PROMPTS, GREEDY["max_new_tokens"])
    # read in place: the file's folder holds its config and tokenizer, never its weights
    kept = conversion_folder(gguf)
    assert not list(kept.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in kept.iterdir()) < 8 << 20


@pytest.mark.skipif(not int4_gemm.available(), reason="packed GGUF needs AVX2 and a compiler")
@pytest.mark.parametrize("model_type", PACKED)
def test_a_converted_q8_0_file_is_served_packed_within_the_gates(files, model_type):
    """Q8_0 blocks as stored against the same blocks dequantized to float32: the packed path's
    int8 activations are not exact, so held to gates (a random tiny model's logits are large)."""
    gguf = files[model_type, "q8_0"][1]
    random.seed(0)
    ids = [random.randrange(TINY["vocab_size"]) for _ in range(64)]
    logits = {}
    for quantization in ("auto", "none"):
        args = {"model": str(gguf), "attention_backend": "torch", "max_total_tokens": 256}
        runner = ModelRunner(ServerArgs(**args, quantization=quantization).executor)
        if quantization == "auto":
            assert runner.quant.name == "gguf", runner.quant.reason
        logits[quantization] = teacher_forced_logits(runner, ids)
    packed, dense = logits["auto"], logits["none"]
    agreement = (packed.argmax(-1) == dense.argmax(-1)).double().mean().item()
    errors = (packed - dense).norm(dim=-1) / dense.norm(dim=-1)
    # with experts, a token whose 8-bit activations tip its router to another expert has other
    # logits altogether (measured: 1 or 2 of 64 positions, the rest within 0.07, as without)
    experts = any(FAMILIES[model_type].get(n) for n in ("num_experts", "num_local_experts"))
    error = errors.quantile(0.95 if experts else 1.0).item()
    # a Mamba-2 layer carries every token's 8-bit rounding on in its state, through decays
    # that rounding moves (measured: 0.84 to 0.95 of the greedy tokens, the logits within 0.07)
    least = 0.8 if model_type in MAMBA else 0.9
    assert agreement >= least and error <= 0.1, (agreement, error)


@pytest.mark.skipif(SERVER is None, reason="llama.cpp's server: `make test` builds it")
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("model_type", AGAINST_LLAMA_CPP)
def test_a_converted_file_predicts_llama_cpps_tokens(files, model_type, outtype):
    """The same file in llama.cpp's own server: its greedy next token at each of 40 positions
    of a random text (teacher-forced) against radixrt's, float32 (`--quantization none`) or
    packed as stored (the defaults): the recurrent layers read as llama.cpp reads them (LFM2's
    layers by KV heads; Qwen3.5's norms, decays and tiled value heads; Qwen3-Next's fused
    projections; Granite 4's Mamba-2 layers and scalars; Falcon-H1's multipliers, folded into
    its tensors), and each expert's matrix sliced from llama.cpp's tensor of every expert's.
    Measured: 1.0 for every float file, 0.95 to 1.0 packed (llama.cpp's 8-bit activations
    differ from radixrt's), 0.875 for Qwen3-MoE's, where the two round a few tokens' routers to
    different experts."""
    gguf = files[model_type, outtype][1]
    random.seed(1)
    ids = [random.randrange(TINY["vocab_size"]) for _ in range(48)]
    quantization = "none" if outtype == "f32" else "auto"
    args = {"model": str(gguf), "attention_backend": "torch", "max_total_tokens": 256}
    runner = ModelRunner(ServerArgs(**args, quantization=quantization).executor)
    ours = teacher_forced_logits(runner, ids)[7:-1].argmax(-1).tolist()
    server = LlamaServerTarget(SERVER, gguf, slots=1, context_length=256)
    try:
        theirs = [server.next_token(ids[:n]) for n in range(8, len(ids))]
    finally:
        server.close()
    agreement = sum(a == b for a, b in zip(ours, theirs)) / len(theirs)
    assert agreement >= (0.95 if outtype == "f32" else 0.85), agreement


SERVED = {"tried": 0, "served": 0, "refused": 0, "seconds": 0.0}
# the files mutated: a Llama's and the hybrid readers' (`gguf_families`)
MUTATED = ("llama", "qwen3_5_text", "granitemoehybrid_experts", "qwen3_moe")


def test_a_width_the_tensors_do_not_hold_is_refused_before_a_model_is_built(files, tmp_path):
    """Granite 4's experts 2^20 wide by the metadata (a model of 4 GB), 64 by the tensors: the
    reader refuses the file by the tensor, in one line, before the model is allocated."""
    source = files["granitemoehybrid_experts", "f32"][1]
    original = source.read_bytes()
    key = _encoded("granitehybrid.feed_forward_length")
    at = original.index(key) + len(key) + 4  # its u32 value, after its name and type
    path = tmp_path / "wide.gguf"
    path.write_bytes(original[:at] + struct.pack("<I", 1 << 20) + original[at + 4 :])
    with pytest.raises(ValueError, match="block_sparse_moe.input_linear.weight holds") as refused:
        make_scheduler(path, quantization="none", max_total_tokens=64)
    assert "\n" not in str(refused.value)


def _values(original: bytes, file: gguf_file.GGUFFile) -> list[tuple[int, int]]:
    """Where the value of each of `file`'s family's keys lies in its bytes, [start, end): after
    the key's name and type, up to the next key."""
    starts = sorted(original.index(_encoded(key)) for key in file.metadata)
    values = []
    for key in file.metadata:
        if key.startswith(f"{file.architecture}."):
            at = original.index(_encoded(key))
            values.append((at + len(_encoded(key)) + 4, starts[starts.index(at) + 1]))
    return values


def _encoded(name: str) -> bytes:
    """A name as a GGUF file stores it: its length (u64), then its bytes."""
    return struct.pack("<Q", len(name.encode())) + name.encode()


@settings(
    max_examples=25,  # a file served costs a model's start (2-3 s)
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_converted_files_are_served_or_refused_in_one_line(files, tmp_path, data):
    """A file llama.cpp's converter made (a Llama's, or one of the hybrid readers': Qwen3.5's,
    Granite 4's with experts, Qwen3-MoE's), mutated: its header or its tensor table (bytes
    overwritten, inserted, cut), or the value of one of its family's keys overwritten in place
    (what the family's config reader derives fields from; a mutation anywhere in the header
    lands in the vocabulary, nearly all of it, and one in the metadata mostly breaks its
    structure). The whole start path (read, config, tokenizer, weights, model) and one greedy
    request either serve it or refuse it with one line (ValueError, which GGUFError is), within
    10 s and 1 GB of peak memory beyond what the suite holds (25 files: a file served costs a
    start)."""
    source = files[data.draw(st.sampled_from(MUTATED)), "f32"][1]
    original, file = source.read_bytes(), gguf_file.read(source)
    header = min(t.offset for t in file.tensors.values())
    where = data.draw(st.sampled_from(["header", "tensor table", "value"]))
    if where == "value":
        lo, hi = data.draw(st.sampled_from(_values(original, file)))
        mutated = original[:lo] + data.draw(st.binary(min_size=hi - lo, max_size=hi - lo))
        mutated += original[hi:]
    else:
        first = _encoded(next(iter(file.tensors)))  # the table's first entry
        lo = 0 if where == "header" else original.rindex(first, 0, header)
        mutated = original[:lo] + mutated_header(data, original[lo:], header - lo)
    path = tmp_path / "mutated.gguf"
    path.write_bytes(mutated)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    start = time.perf_counter()
    SERVED["tried"] += 1
    try:
        scheduler = make_scheduler(path, quantization="none", max_total_tokens=64)
        params = {**GREEDY, "max_new_tokens": 2}
        (req,) = requests_in_process(scheduler, [[PROMPTS[0]]], params)
        reason = req.finish_reason
        # served: two tokens, or logits no token can be sampled from (a mutated norm epsilon
        # or rope base: NaN), which fail that request alone with its error
        assert len(req.output_ids) == 2 or (reason.error is not None and "\n" not in reason.message)
        SERVED["served"] += 1
    except ValueError as e:
        assert "\n" not in str(e), e
        SERVED["refused"] += 1
    seconds = time.perf_counter() - start
    SERVED["seconds"] = max(SERVED["seconds"], seconds)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert seconds < 10 and grown < 1 << 30, (seconds, grown)
