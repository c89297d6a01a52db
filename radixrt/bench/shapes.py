"""Random-weight checkpoints of real models' shapes, for benchmarks at the size users run
(`radixrt bench --model-shape tinyllama-1.1b`): made once under `$RADIXRT_CACHE_DIR/shapes/`,
as a Hugging Face folder (safetensors, float32 up to 1.1B and bfloat16 above, so that the
state dict fits in memory while it is written; the default model's tokenizer) and as GGUF files
of the same weights (Q4_0, Q4_K_M, Q6_K, Q8_0) for llama.cpp, converted with the converter that
llama.cpp's sources (vendored in llama-cpp-python's source distribution) ship (`make test`
fetches it), and quantized by llama.cpp's llama-quantize.

Random weights cost what trained ones cost: the same matmuls, the same bytes read per token.
Their text is noise, so no quality is measured on them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from tqdm import tqdm


class LlamaShape(TypedDict):
    """A shape's `LlamaConfig` keywords."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool


# TinyLlama-1.1B's shape, with the default model's vocabulary (49,152 tokens: its tokenizer is the
# one on this machine) where TinyLlama has 32,000: 1.17B parameters instead of 1.10B.
SHAPES: dict[str, LlamaShape] = {
    "tinyllama-1.1b": LlamaShape(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-3B's (3.2B parameters with its 128k vocabulary, 2.9B with this one)
    "llama-3.2-3b": LlamaShape(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}
BFLOAT16_SHAPES = ("llama-3.2-3b",)  # written in bfloat16: 12 GB of float32 would not fit
GGUF_TYPES = {
    "Q4_0": 2,
    "Q4_K_M": 15,
    "Q6_K": 18,
    "Q8_0": 7,
}  # llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*)
_DONE = ".radixrt-done"


@dataclass(frozen=True)
class ShapeFiles:
    """One shape's checkpoint: the Hugging Face folder and its GGUF files by type."""

    folder: Path
    ggufs: dict[str, Path]


def prepare(shape: str) -> ShapeFiles:
    """The shape's files, made on first use (minutes: weights written, converted, quantized)."""
    from radixrt.executor.model_loader import cache_dir

    root = cache_dir() / "shapes" / shape
    folder = root / "hf"
    if not (folder / _DONE).is_file():
        _write_checkpoint(shape, folder)
    ggufs = {kind: gguf_path(shape, kind) for kind in GGUF_TYPES}
    if not all(p.is_file() for p in ggufs.values()):
        f16 = root / f"{shape}-F16.gguf"
        if not f16.is_file():
            _convert(folder, f16)
        for kind, path in ggufs.items():
            if not path.is_file():
                _quantize(f16, path, kind)
        f16.unlink()
    return ShapeFiles(folder, ggufs)


def gguf_path(shape: str, kind: str) -> Path:
    """Where the shape's GGUF file of `kind` lies once `prepare` has made it."""
    from radixrt.executor.model_loader import cache_dir

    return cache_dir() / "shapes" / shape / f"{shape}-{kind}.gguf"


def _write_checkpoint(shape: str, folder: Path) -> None:
    """Seeded N(0, 0.02) weights under transformers' Llama names, written tensor by tensor into
    one safetensors file, with the config and the default model's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from radixrt.executor.model_loader import resolve_model_path

    default = resolve_model_path("default")
    base = AutoConfig.from_pretrained(default)
    # transformers 5 types neither the rope_theta keyword nor a torch_dtype setter (rope_parameters
    # and dtype replace them) yet still takes both, the names transformers 4 knows
    config = LlamaConfig(  # type: ignore[misc]
        **SHAPES[shape],
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = "bfloat16" if shape in BFLOAT16_SHAPES else "float32"  # type: ignore[misc]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if shape in BFLOAT16_SHAPES else torch.float32
    state = {}
    for name, size in tqdm(shapes.items(), desc=f"random {shape} weights"):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(size, dtype=dtype)
        else:
            state[name] = torch.randn(size, generator=gen).mul_(0.02).to(dtype)
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding's, as save_pretrained leaves it out
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    for f in default.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json":
            shutil.copy(f, folder / f.name)
    (folder / _DONE).write_text(shape)


def _convert(folder: Path, out: Path) -> None:
    """llama.cpp's `convert_hf_to_gguf.py` (`peers.llama_cpp_converter`: the one `make test`
    fetched, with its own gguf-py), to a float16 GGUF."""
    from radixrt.bench.peers import llama_cpp_converter

    converter = llama_cpp_converter()
    if converter is None:
        raise FileNotFoundError(
            "llama.cpp's converter: `make test` or `make bench-peers` fetches it"
        )
    env = {**os.environ, "PYTHONPATH": f"{converter / 'gguf-py'}:{converter}"}
    subprocess.run(
        [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder)]
        + ["--outtype", "f16", "--outfile", str(out)],
        check=True,
        env=env,
    )


def _quantize(f16: Path, out: Path, kind: str) -> None:
    """llama.cpp's quantizer: `llama-quantize` where `make bench-peers` built it
    (`peers.llama_cpp_tool`), else the same code through llama-cpp-python
    (`llama_model_quantize`)."""
    from radixrt.bench.peers import llama_cpp_tool

    binary = llama_cpp_tool("llama-quantize")
    if binary is not None:
        subprocess.run([str(binary), str(f16), str(out), kind], check=True)
        return
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = GGUF_TYPES[kind]
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f16} to {kind}")
    os.replace(tmp, out)
