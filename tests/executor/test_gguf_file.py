"""radixrt's own GGUF reader (`executor/gguf_file.py`) against gguf-py, the reader llama.cpp
ships: the same metadata and tensor table on a file gguf-py's writer made; and against hostile
files: each is refused with a `GGUFError` naming the field, in bounded time and memory, never
another exception (a fuzz test mutates a valid file's header, metadata and tensor table); and
a value the model's config class refuses, in one line naming its key."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.executor import gguf_file
from radixrt.executor.gguf_file import GGUFError
from radixrt.executor.model_loader import gguf_config

from helpers import mutated_header

VOCAB = ["<unk>", "<s>", "</s>", *(f"tok{i}" for i in range(29)), "héllo", ""]
HIDDEN = 32
EPSILON = "llama.attention.layer_norm_rms_epsilon"
# gguf-py's writer of a metadata value, by the value's type (`write`'s `extra`)
ADD = {list: "add_array", str: "add_string", float: "add_float32", int: "add_uint32"}


def write(path, *, blocks=1, vocab=VOCAB, extra=None, embedding_rows=None):
    """A small llama GGUF by gguf-py's writer: metadata of every value type (`extra`'s in place
    of the defaults, each as its Python type: `ADD`), a vocabulary and one block's tensors (F32,
    F16, Q8_0)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(4)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_int8("test.i8", -3)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_float64("test.f64", 0.25)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([float(-i) for i in range(len(vocab))])
    writer.add_chat_template("{{ messages }}")
    for key, value in {EPSILON: 1e-5, **(extra or {})}.items():
        getattr(writer, ADD[type(value)])(key, value)
    rng = np.random.default_rng(0)
    rows = embedding_rows or len(vocab)
    writer.add_tensor("token_embd.weight", rng.standard_normal((rows, HIDDEN), dtype=np.float32))
    for i in range(blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float16))
        q = gguf.quants.quantize(rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32), 8)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def valid_path(tmp_path_factory):
    return write(tmp_path_factory.mktemp("gguf") / "valid.gguf")


@pytest.fixture(scope="module")
def valid(valid_path):
    return valid_path.read_bytes()


def test_reads_what_ggufs_reader_reads(tmp_path):
    path = write(tmp_path / "m.gguf")
    ours, theirs = gguf_file.read(path), gguf.GGUFReader(path)
    assert set(ours.metadata) == set(theirs.fields) - {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        if (
            field.types[0] == gguf.GGUFValueType.ARRAY
            and field.types[-1] == gguf.GGUFValueType.STRING
        ):
            assert value.tolist() == [bytes(field.parts[i]).decode() for i in field.data], key
        elif field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[-1]).decode(), key
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value.tolist() == [field.parts[i][0].item() for i in field.data], key
        else:
            assert value == field.parts[-1][0].item(), key
    assert ours.metadata["tokenizer.ggml.tokens"][-2] == "héllo"
    assert ours.metadata["tokenizer.ggml.tokens"][-1] == ""
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.kind.id, mine.kind.name) == (int(t.tensor_type), t.tensor_type.name)
        assert mine.shape == tuple(int(n) for n in t.shape)
        assert (mine.offset, mine.n_bytes) == (t.data_offset, t.n_bytes)
    gguf_file.check(ours)


def test_the_type_table_is_ggmls():
    for kind in gguf_file.GGML_TYPES.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind.id)] == (kind.block, kind.bytes)
        assert gguf.GGMLQuantizationType(kind.id).name == kind.name


def test_a_large_vocabulary_reads_in_well_under_a_second(tmp_path):
    """Gemma 3's 262,144 tokens: one pass over their lengths, no object per entry."""
    vocab = [f"t{i}" for i in range(262_144)]
    path = write(tmp_path / "big.gguf", vocab=vocab)
    start = time.perf_counter()
    tokens = gguf_file.read(path).metadata["tokenizer.ggml.tokens"]
    assert time.perf_counter() - start < 0.5
    assert len(tokens) == 262_144 and tokens[123_456] == "t123456"


def _patched(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1, old
    return data.replace(old, new)


def _key(data: bytes, key: str) -> int:
    """Where the value of metadata `key` starts (after its type)."""
    encoded = key.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return at + 8 + len(encoded) + 4


def _hostile(valid: bytes, probe: str) -> bytes:
    """The issue's probes, each a few bytes changed in a valid file."""
    data = bytearray(valid)
    if probe == "block_count":
        at = _key(valid, "llama.block_count")
        data[at : at + 4] = struct.pack("<I", 10**9)
    elif probe == "context_length":
        at = _key(valid, "llama.context_length")
        data[at : at + 4] = struct.pack("<I", 2**32 - 1)
    elif probe == "tensor_offset":  # the last tensor's offset, wrapped past 2^64
        name = b"blk.0.attn_q.weight"
        at = valid.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 16 + 4
        data[at : at + 8] = struct.pack("<Q", 2**64 - 4096)
    elif probe == "array_count":  # an array claiming 40M entries
        at = _key(valid, "test.ints") + 4
        data[at : at + 8] = struct.pack("<Q", 40_000_000)
    elif probe == "string_length":
        at = _key(valid, "tokenizer.chat_template")
        data[at : at + 8] = struct.pack("<Q", 2**62)
    elif probe == "tensor_count":
        data[8:16] = struct.pack("<Q", 2**40)
    elif probe == "truncated":
        return bytes(data[: len(data) // 2])
    return bytes(data)


@pytest.mark.parametrize(
    ("probe", "field"),
    [
        ("block_count", "llama.block_count"),
        ("context_length", "llama.context_length"),
        ("tensor_offset", "tensor blk.0.attn_q.weight"),
        ("array_count", "test.ints length"),
        ("string_length", "tokenizer.chat_template"),
        ("tensor_count", "tensor_count"),
        ("truncated", "tensor"),
    ],
)
def test_hostile_headers_are_refused_by_field(valid, tmp_path, probe, field):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_hostile(valid, probe))
    with pytest.raises(GGUFError, match=field):
        gguf_file.check(gguf_file.read(path))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"extra": {"test.big": [0] * (gguf_file.MAX_ARRAY + 1)}}, "test.big"),
        ({"extra": {"test.empty": [""] * (gguf_file.MAX_ARRAY + 1)}}, "test.empty"),
        ({"embedding_rows": len(VOCAB) + 1}, "token_embd.weight"),
        ({"extra": {"llama.expert_count": 8}}, "llama.expert_count"),  # no tensors of experts
        ({"extra": {"tokenizer.ggml.merges": ["a b"] * (4 * len(VOCAB) + 1)}}, "merges"),
    ],
)
def test_metadata_past_what_the_model_can_use_is_refused(tmp_path, kwargs, field):
    """Arrays larger than any model's (2M empty strings, 40M numbers in the issue's probes), a
    vocabulary that is not the embedding's rows and experts the file does not hold: refused
    before anything is built from them."""
    with pytest.raises(GGUFError, match=field):
        gguf_file.check(gguf_file.read(write(tmp_path / "m.gguf", **kwargs)))


def test_a_hostile_file_is_one_line_and_exit_status_2(valid, tmp_path):
    """From the command line: no traceback, the field named, status 2, no folder left behind."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(_hostile(valid, "block_count"))
    env = {**os.environ, "RADIXRT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-P", "-m", "radixrt", "prepare-model", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "llama.block_count" in out.stderr, out.stderr
    assert not list((tmp_path / "cache" / "models").glob("*"))


WORST = {"seconds": 0.0, "bytes": 0, "read": 0, "refused": 0}


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_files_are_read_or_refused_in_bounded_time_and_memory(valid_path, tmp_path, data):
    """Bytes of the header, metadata and tensor table overwritten, inserted or cut: `read` and
    `check` accept the file or raise GGUFError, within 10 s and 64 MB of Python allocations."""
    header = min(t.offset for t in gguf_file.read(valid_path).tensors.values())  # data's start
    mutated = mutated_header(data, valid_path.read_bytes(), header)
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(mutated)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        gguf_file.check(gguf_file.read(path))
        WORST["read"] += 1
    except GGUFError as e:
        assert "\n" not in str(e)
        WORST["refused"] += 1
    finally:
        seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
        tracemalloc.stop()
    WORST["seconds"], WORST["bytes"] = max(WORST["seconds"], seconds), max(WORST["bytes"], peak)
    assert seconds < 10 and peak < 64 << 20


def test_a_value_of_the_wrong_type_is_refused_in_one_line(tmp_path):
    """A string where transformers' config class wants a float: its strict fields' error (over
    two lines) becomes one, naming the file, the metadata key and the config field."""
    path = write(tmp_path / "typed.gguf", extra={EPSILON: "small"})
    with pytest.raises(ValueError) as refused:
        gguf_config(gguf_file.read(path))
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith(f"typed.gguf: metadata {EPSILON} (rms_norm_eps): "), message
