"""A GGUF file read in place: header, metadata and tensor table parsed from a read-only map of
the file, every count, length, offset and dimension checked against the bytes that hold it
before anything is sized by it.

A GGUF file is untrusted input (a download, a file a tenant names): a hostile header must end
in a `GGUFError` naming the field, in time and memory bounded by the file's size, never in a
raw `struct.error`, a wrapped offset served from the header's bytes, or gigabytes allocated for
a count the file cannot hold. So:
- each count is checked against the bytes left before a loop runs over it (a metadata pair
  takes at least 12 bytes, a tensor info at least 24, an array element its own size or 8 for a
  string), and each length against the bytes left before it is read;
- a tensor's dimensions are positive, at most 4 (ggml's `GGML_MAX_DIMS`), its first a multiple
  of its type's block, its offset aligned, and its data inside the file (offsets are Python
  ints: nothing wraps);
- metadata is held in proportion to the file: scalars as Python values, numeric arrays as one
  numpy array each, string arrays as their bytes and an offsets table (`StringArray`, decoded
  on access), so a 2M-empty-string array costs ~32 MB, not a Python object per entry.
The layout follows llama.cpp's `gguf.cpp` (the writer of the files people download): version 2
or 3, little-endian, `general.alignment` (a power of two, 32 when absent), tensor data after
the padded tensor table. Nested arrays are refused, as llama.cpp refuses them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from radixrt.models.support import MAX_CONTEXT


class GGUFError(ValueError):
    """A GGUF file refused: one line naming the file and the field at fault."""


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type: its id in the file, name, values per block and bytes per block."""

    id: int
    name: str
    block: int
    bytes: int


# ggml's types as ggml.h numbers them (ggml_type_traits' block sizes; Q8_1, a type of the
# CPU's own dot products that no file stores, left out); tests/executor check
# them against gguf-py's GGML_QUANT_SIZES
GGML_TYPES = {
    t.id: t
    for t in (
        GgmlType(0, "F32", 1, 4),
        GgmlType(1, "F16", 1, 2),
        GgmlType(2, "Q4_0", 32, 18),
        GgmlType(3, "Q4_1", 32, 20),
        GgmlType(6, "Q5_0", 32, 22),
        GgmlType(7, "Q5_1", 32, 24),
        GgmlType(8, "Q8_0", 32, 34),
        GgmlType(10, "Q2_K", 256, 84),
        GgmlType(11, "Q3_K", 256, 110),
        GgmlType(12, "Q4_K", 256, 144),
        GgmlType(13, "Q5_K", 256, 176),
        GgmlType(14, "Q6_K", 256, 210),
        GgmlType(15, "Q8_K", 256, 292),
        GgmlType(16, "IQ2_XXS", 256, 66),
        GgmlType(17, "IQ2_XS", 256, 74),
        GgmlType(18, "IQ3_XXS", 256, 98),
        GgmlType(19, "IQ1_S", 256, 50),
        GgmlType(20, "IQ4_NL", 32, 18),
        GgmlType(21, "IQ3_S", 256, 110),
        GgmlType(22, "IQ2_S", 256, 82),
        GgmlType(23, "IQ4_XS", 256, 136),
        GgmlType(24, "I8", 1, 1),
        GgmlType(25, "I16", 1, 2),
        GgmlType(26, "I32", 1, 4),
        GgmlType(27, "I64", 1, 8),
        GgmlType(28, "F64", 1, 8),
        GgmlType(29, "IQ1_M", 256, 56),
        GgmlType(30, "BF16", 1, 2),
        GgmlType(34, "TQ1_0", 256, 54),
        GgmlType(35, "TQ2_0", 256, 66),
        GgmlType(39, "MXFP4", 32, 17),
    )
}

# metadata value types (gguf's GGUFValueType) -> numpy dtype of one value; 8 string, 9 array
SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
BOOL, STRING, ARRAY = 7, 8, 9
ALIGNMENT = 32  # where tensor data starts when `general.alignment` does not say
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NAME = 64  # ggml's GGML_MAX_NAME, a tensor name's bytes with its terminator
KV_MIN_BYTES = 8 + 4 + 1  # a key's length, the value's type, one byte of value
TENSOR_MIN_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dims, one dimension, type, offset


class StringArray:
    """A metadata array of strings, held as the bytes they occupy in the file (each a u64
    length, then the string) and where each string starts: at most twice the array's bytes.
    An entry is decoded (UTF-8, invalid bytes replaced) when it is read."""

    def __init__(self, blob: bytes, starts: np.ndarray):
        self._blob, self._starts = blob, starts

    def __len__(self) -> int:
        return len(self._starts)

    def _ends(self) -> list[int]:
        """Where each string ends: 8 bytes (the next one's length) before the next starts."""
        return [s - 8 for s in self._starts[1:].tolist()] + [len(self._blob)]

    def __getitem__(self, i: int) -> str:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        end = int(self._starts[i + 1]) - 8 if i + 1 < len(self) else len(self._blob)
        return self._blob[int(self._starts[i]) : end].decode("utf-8", errors="replace")

    def tolist(self) -> list[str]:
        blob = self._blob
        return [
            blob[s:e].decode("utf-8", errors="replace")
            for s, e in zip(self._starts.tolist(), self._ends())
        ]


Value = int | float | bool | str | np.ndarray | StringArray


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file as its table describes it: its type, `shape` in GGUF's order
    (inputs first: [K, N] for a linear), where its bytes start in `path` (from the file's
    start) and how many there are: all checked to lie inside the file."""

    name: str
    kind: GgmlType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int
    path: Path


def experts(tensor: TensorInfo) -> list[TensorInfo]:
    """A tensor of every expert's matrix (llama.cpp's `ffn_*_exps`: [K, N, E] in GGUF's order)
    as E tensors [K, N] (named by `expert_name`): blocks run along K, so each expert's
    rows are one run of the file's bytes and read, dequantize and pack as a matrix of its own.
    GGUFError for a tensor that is not 3-D or whose bytes do not split evenly."""
    if len(tensor.shape) != 3 or tensor.shape[2] < 1 or tensor.n_bytes % tensor.shape[2]:
        raise GGUFError(f"tensor {tensor.name!r}: {tensor.shape} is not one matrix per expert")
    k, n, count = tensor.shape
    size = tensor.n_bytes // count
    return [
        replace(
            tensor,
            name=expert_name(tensor.name, e),
            shape=(k, n),
            offset=tensor.offset + e * size,
            n_bytes=size,
        )
        for e in range(count)
    ]


def expert_name(name: str, expert: int) -> str:
    """The name `experts` gives expert `expert`'s matrix of tensor `name`."""
    return f"{name}[{expert}]"


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (key -> `Value`) and tensors (name -> `TensorInfo`), as `read`
    parsed and checked them; the file itself is not kept open."""

    path: Path
    version: int
    metadata: dict[str, Value]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: general.architecture is missing or not a string")
        return arch

    def strings(self) -> dict[str, str]:
        """The string-valued metadata."""
        return {k: v for k, v in self.metadata.items() if isinstance(v, str)}

    def number(self, key: str, default: int | float | None = None) -> int | float:
        """A numeric scalar; GGUFError naming `key` where it is missing (without a default) or
        not a number."""
        value = self.metadata.get(key, default)
        if value is None:
            raise GGUFError(f"{self.path.name}: metadata {shown(key)} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GGUFError(f"{self.path.name}: metadata {shown(key)} is not a number")
        return value


def shown(text: str, limit: int = 80) -> str:
    """A name taken from the file, fit for a one-line message: control characters escaped,
    at most `limit` characters."""
    if text.isprintable() and len(text) <= limit:
        return text
    escaped = text.encode("unicode_escape").decode("ascii")
    return escaped if len(escaped) <= limit else f"{escaped[:limit]}..."


class _Cursor:
    """Reads through the map with every length checked against the bytes left; `field` names
    what is being read for the error."""

    def __init__(self, buf: memoryview, name: str):
        self.buf, self.at, self.size, self.name = buf, 0, len(buf), name

    def fail(self, field: str, why: str) -> GGUFError:
        return GGUFError(f"{self.name}: {shown(field)}: {why}")

    def need(self, n: int, field: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise self.fail(
                field, f"{n} bytes at offset {self.at} run past the file's end ({self.size})"
            )

    def left(self) -> int:
        return self.size - self.at

    def scalar(self, dtype: np.dtype[Any], field: str) -> int | float:
        self.need(dtype.itemsize, field)
        value = np.frombuffer(self.buf, dtype, 1, self.at)[0].item()
        self.at += dtype.itemsize
        return value  # type: ignore[no-any-return]

    def u32(self, field: str) -> int:
        return int(self.scalar(SCALARS[4], field))

    def u64(self, field: str) -> int:
        return int(self.scalar(SCALARS[10], field))

    def count(self, field: str, each: int) -> int:
        """A u64 count of items of at least `each` bytes, checked to fit in what is left."""
        n = self.u64(field)
        if n * each > self.left():
            raise self.fail(field, f"{n} entries cannot fit in the {self.left()} bytes left")
        return n

    def raw_string(self, field: str) -> bytes:
        n = self.u64(field)
        self.need(n, field)
        out = bytes(self.buf[self.at : self.at + n])
        self.at += n
        return out

    def string(self, field: str) -> str:
        return self.raw_string(field).decode("utf-8", errors="replace")


def read(path: str | Path) -> GGUFFile:
    """Parse and check `path`'s header, metadata and tensor table (see the module docstring);
    GGUFError, one line naming the field, for anything the file cannot hold."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GGUFError(f"{path.name}: an empty file is not GGUF") from None
    with mapped, memoryview(mapped) as buf:
        try:
            return _parse(path, buf)
        finally:
            del buf  # no export of the map outlives it (its close would fail)


def _parse(path: Path, buf: memoryview) -> GGUFFile:
    c = _Cursor(buf, path.name)
    c.need(4, "magic")
    if bytes(buf[:4]) != b"GGUF":
        raise c.fail("magic", "not a GGUF file")
    c.at = 4
    version = c.u32("version")
    if version not in (2, 3):
        raise c.fail("version", f"{version}: only GGUF v2 and v3 are read")
    n_tensors = c.u64("tensor_count")
    n_kv = c.count("metadata_kv_count", KV_MIN_BYTES)
    if n_tensors * TENSOR_MIN_BYTES > c.left():
        raise c.fail("tensor_count", f"{n_tensors} tensors cannot fit in the {c.left()} bytes left")
    metadata: dict[str, Value] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in metadata:
            raise c.fail(key, "the key appears twice")
        metadata[key] = _value(c, key, c.u32(f"{key} type"))
    alignment = metadata.get("general.alignment", ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise c.fail("general.alignment", f"{alignment!r} is not a power of two")
    table = [_tensor_info(c, i) for i in range(n_tensors)]
    start = -(-c.at // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, kind, shape, offset in table:
        field = f"tensor {name}"
        if name in tensors:
            raise c.fail(field, "the name appears twice")
        if offset % alignment:
            raise c.fail(field, f"offset {offset} is not a multiple of the alignment {alignment}")
        n_bytes = _elements(shape) // kind.block * kind.bytes
        if start + offset + n_bytes > c.size:
            raise c.fail(
                field, f"its {n_bytes} bytes at data offset {offset} run past the file's end"
            )
        tensors[name] = TensorInfo(name, kind, shape, start + offset, n_bytes, path)
    return GGUFFile(path, version, metadata, tensors)


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_info(c: _Cursor, i: int) -> tuple[str, GgmlType, tuple[int, ...], int]:
    raw = c.raw_string(f"tensor {i} name")
    name = raw.decode("utf-8", errors="replace")
    field = f"tensor {name}"
    if len(raw) >= MAX_NAME:
        raise c.fail(field, f"a name of {len(raw)} bytes (ggml takes at most {MAX_NAME - 1})")
    dims = c.u32(f"{field} n_dims")
    if not 1 <= dims <= MAX_DIMS:
        raise c.fail(field, f"{dims} dimensions (1 to {MAX_DIMS})")
    c.need(8 * dims, f"{field} dims")
    shape = tuple(int(d) for d in np.frombuffer(c.buf, SCALARS[10], dims, c.at))
    c.at += 8 * dims
    kind_id = c.u32(f"{field} type")
    kind = GGML_TYPES.get(kind_id)
    if kind is None:
        raise c.fail(field, f"unknown ggml type {kind_id}")
    if any(d <= 0 for d in shape):
        raise c.fail(field, f"shape {list(shape)} has an empty dimension")
    if shape[0] % kind.block:
        raise c.fail(
            field, f"its rows of {shape[0]} are not whole {kind.name} blocks of {kind.block}"
        )
    if _elements(shape) // kind.block * kind.bytes > c.size:  # before any product is used
        raise c.fail(field, f"shape {list(shape)} is larger than the whole file")
    return name, kind, shape, c.u64(f"{field} offset")


def _value(c: _Cursor, key: str, kind: int) -> Value:
    """One metadata value of type `kind`."""
    if kind in SCALARS:
        value = c.scalar(SCALARS[kind], key)
        return bool(value) if kind == BOOL else value
    if kind == STRING:
        return c.string(key)
    if kind != ARRAY:
        raise c.fail(key, f"unknown metadata type {kind}")
    element = c.u32(f"{key} element type")
    if element in SCALARS:
        dtype = SCALARS[element]
        n = c.count(f"{key} length", dtype.itemsize)
        array: np.ndarray = np.frombuffer(c.buf, dtype, n, c.at).copy()
        c.at += n * dtype.itemsize
        return array.astype(bool) if element == BOOL else array
    if element == STRING:
        return _string_array(c, key, c.count(f"{key} length", 8))
    if element == ARRAY:
        raise c.fail(key, "nested arrays are not read (llama.cpp refuses them too)")
    raise c.fail(key, f"unknown array element type {element}")


def _string_array(c: _Cursor, key: str, n: int) -> StringArray:
    """`n` strings, each a u64 length and its bytes: walked once for where each lies (a 262k
    vocabulary in tens of milliseconds), then copied as one blob."""
    first = c.at
    starts = np.empty(n, np.int64)
    buf, at, size = c.buf, c.at, c.size
    unpack = struct.Struct("<Q").unpack_from
    for i in range(n):
        if at + 8 > size:
            c.at = at
            raise c.fail(f"{key}[{i}]", "the array runs past the file's end")
        (length,) = unpack(buf, at)
        at += 8
        if length > size - at:
            c.at = at
            raise c.fail(f"{key}[{i}]", f"a string of {length} bytes runs past the file's end")
        starts[i] = at - first
        at += length
    c.at = at
    return StringArray(bytes(buf[first:at]), starts)


# bounds a file's metadata must keep before anything is built from it (`check`): each above
# every released model's, so only a hostile or broken file meets one
MAX_VOCAB = 1 << 21  # tokens (the largest served vocabularies hold 262,144)
MAX_MERGES_PER_TOKEN = 4  # BPE merges per token (Llama 3: 2.2)
MAX_ARRAY = 1 << 16  # elements of an array outside the tokenizer's (per-layer values)
TOKENIZER = "tokenizer.ggml."
EXPERTS_SUFFIX = "_exps.weight"  # llama.cpp's tensors of every expert's matrix (`experts`)


def check(file: GGUFFile) -> None:
    """Refuse, by the field's name, metadata that would size what is built from it past what
    the file holds: a block count without its blocks' tensors, an expert count that is not
    the experts' tensors' (`experts`), a vocabulary that is not the embedding's rows, arrays
    and a context length beyond `MAX_*`. `read` has checked the file's
    own structure; this checks what the model's config and tokenizer take from it."""
    name, arch = file.path.name, file.architecture
    if shown(arch) != arch:
        raise GGUFError(f"{name}: general.architecture {shown(arch)} is no architecture's name")
    blocks = file.number(f"{arch}.block_count")
    if not isinstance(blocks, int) or blocks < 1:
        raise GGUFError(f"{name}: {arch}.block_count {blocks!r} is not a positive integer")
    present = {n.split(".")[1] for n in file.tensors if n.startswith("blk.")}
    missing = next((i for i in range(blocks) if str(i) not in present), None)
    if missing is not None:
        raise GGUFError(
            f"{name}: {arch}.block_count is {blocks}, but block {missing} has no tensors"
        )
    context = file.number(f"{arch}.context_length", 0)
    if not 0 <= context <= MAX_CONTEXT:
        raise GGUFError(f"{name}: {arch}.context_length {context} is beyond {MAX_CONTEXT:,} tokens")
    if f"{arch}.expert_count" in file.metadata:  # the model builds this many experts a layer
        count = file.number(f"{arch}.expert_count")
        held = {t.shape[-1] for t in file.tensors.values() if t.name.endswith(EXPERTS_SUFFIX)}
        if held != ({count} if count else set()):
            raise GGUFError(
                f"{name}: {arch}.expert_count is {count}, but the tensors of every expert's"
                f" (*{EXPERTS_SUFFIX}) hold {sorted(held) or 'none'}"
            )
    tokens = file.metadata.get(f"{TOKENIZER}tokens")
    vocab = len(tokens) if isinstance(tokens, StringArray) else 0
    if vocab > MAX_VOCAB:
        raise GGUFError(f"{name}: {TOKENIZER}tokens holds {vocab:,} tokens (at most {MAX_VOCAB:,})")
    embedding = file.tensors.get("token_embd.weight")
    if embedding is not None and vocab and embedding.shape[-1] != vocab:
        raise GGUFError(
            f"{name}: {TOKENIZER}tokens holds {vocab:,} tokens, token_embd.weight"
            f" {embedding.shape[-1]:,} rows"
        )
    for key, value in file.metadata.items():
        if not isinstance(value, np.ndarray | StringArray):
            continue
        if key == f"{TOKENIZER}merges":
            limit = MAX_MERGES_PER_TOKEN * vocab
        elif key.startswith(TOKENIZER):
            limit = max(vocab, MAX_ARRAY)
        else:
            limit = MAX_ARRAY
        if len(value) > limit:
            raise GGUFError(
                f"{name}: {shown(key)} holds {len(value):,} entries (at most {limit:,} read)"
            )
