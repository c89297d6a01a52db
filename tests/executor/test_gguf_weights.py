"""GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and K-quant tensors read into the grouped kernel's packed layout: what they
stand for equals gguf's own dequantization, row orders and stacking included. A small GGUF file
is written with gguf's writer and read back with its reader, the path serving uses."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import LlamaConfig

from radixrt.executor import gguf_file, gguf_weights
from radixrt.kernels import int4_gemm

from helpers import write_random_gguf

K = 96  # three groups
CONFIG = LlamaConfig(
    hidden_size=K, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
)
# name -> (rows, type): q and k are 4-bit, v 8-bit: q/k/v stack as 8-bit groups; gate is 4-bit
# and up 5-bit: gate/up stack as 5-bit groups (gate's exactly)
TENSORS = {
    "blk.0.attn_q.weight": (K, T.Q4_0),
    "blk.0.attn_k.weight": (48, T.Q4_1),
    "blk.0.attn_v.weight": (48, T.Q8_0),
    "blk.0.attn_output.weight": (K, T.Q5_1),
    "blk.0.ffn_gate.weight": (40, T.Q4_0),
    "blk.0.ffn_up.weight": (40, T.Q5_0),
    "blk.0.ffn_down.weight": (K, T.F32),
    "token_embd.weight": (50, T.Q8_0),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A llama GGUF of TENSORS (random weights, quantized by gguf) and its reader."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_random_gguf(path, TENSORS, K)
    return path, {t.name: t for t in gguf.GGUFReader(path).tensors}


def _dequantized(tensor) -> torch.Tensor:
    """gguf's own float32 reading of a tensor, [rows, K]."""
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())


@pytest.mark.parametrize(
    "name",
    [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_up.weight",
        "token_embd.weight",
    ],
)
def test_packed_blocks_equal_ggufs_dequantization(written, name):
    """Q4_0, Q4_1, Q5_1, Q5_0 and Q8_0: the blocks copied as stored stand for gguf's values
    exactly, at their own size (5-bit groups for Q5_0 and Q5_1)."""
    q, d, m, bits = gguf_weights.blocks(gguf_file.read(written[0]).tensors[name])
    packed = int4_gemm.PackedGroups.from_blocks(q, d, m, K, bits)
    assert torch.equal(packed.dequantize(), _dequantized(written[1][name]))


def test_the_plan_stacks_packed_tensors_in_the_widest_width(written):
    """q/k/v mix 4- and 8-bit types: they stack as 8-bit groups (the 4-bit ones requantized,
    within half an 8-bit step); gate/up mix 4 and 5 bits: 5-bit groups, gate's exactly as
    stored; down is float. The
    embedding table is packed as stored too, never filled as float."""
    plan = gguf_weights.plan(written[0], CONFIG)
    packed = {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"}
    packed |= {"layers.0.mlp.gate_up_proj", "lm_head", "embed_tokens"}
    assert set(plan.linears) == packed
    assert plan.meta_weights(tied=False) == {f"{m}.weight" for m in packed}
    linears = gguf_weights.read_linears(plan)
    embedding = _dequantized(written[1]["token_embd.weight"])
    assert torch.equal(linears["embed_tokens"].dequantize(), embedding)
    gate_up = torch.cat([_dequantized(written[1][f"blk.0.ffn_{p}.weight"]) for p in ("gate", "up")])
    assert torch.equal(linears["layers.0.mlp.gate_up_proj"].dequantize(), gate_up)
    assert linears["layers.0.mlp.gate_up_proj"].bits == int4_gemm.Bits.INT5  # gate widened
    assert linears["lm_head"].bits == int4_gemm.Bits.INT8
    qkv = linears["layers.0.self_attn.qkv_proj"]
    assert qkv.bits == int4_gemm.Bits.INT8
    v = _dequantized(written[1]["blk.0.attn_v.weight"])
    assert torch.equal(qkv.dequantize()[-48:], v)  # already 8-bit: as stored
    k_rows = qkv.dequantize()[K : K + 48].view(48, -1, 32)
    k_want = _dequantized(written[1]["blk.0.attn_k.weight"])[gguf_weights._unpermute(48, 2)]
    k_want = k_want.view(48, -1, 32)
    assert ((k_rows - k_want).abs() <= k_want.abs().amax(2, keepdim=True) / 254 * 1.01 + 1e-7).all()


def test_a_tied_model_looks_tokens_up_in_its_output_projections_groups(written):
    """Tied, the embedding has no entry of its own: it is the output projection's groups (made
    from token_embd), and neither weight is filled as float."""
    tied = LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
    plan = gguf_weights.plan(written[0], tied)
    assert (
        "embed_tokens" not in plan.linears
        and plan.linears["lm_head"][0].name == "token_embd.weight"
    )
    assert {"lm_head.weight", "embed_tokens.weight"} <= plan.meta_weights(tied=True)


def test_q_and_k_rows_are_put_back_in_hugging_faces_order():
    """llama.cpp's converter's permutation (convert_hf_to_gguf.py, LlamaModel.permute), undone."""
    heads, rows = 4, 32
    hf = torch.arange(rows * 3.0).view(rows, 3)
    converted = hf.reshape(heads, 2, rows // heads // 2, 3).swapaxes(1, 2).reshape(rows, 3)
    assert torch.equal(converted[gguf_weights._unpermute(rows, heads)], hf)


KQ = 512  # two K-quant super-blocks a row
# block type -> (values a block, bytes a block, offsets of its float16 fields)
K_QUANTS = {
    T.Q4_K: (256, 144, (0, 2)),
    T.Q5_K: (256, 176, (0, 2)),
    T.Q6_K: (256, 210, (208,)),
    T.Q3_K: (256, 110, (108,)),
    T.Q2_K: (256, 84, (80, 82)),
    T.IQ4_XS: (256, 136, (0,)),
    T.IQ4_NL: (32, 18, (0,)),
}


def _k_quant_tensor(tmp_path, kind, rows: int = 24):
    """A GGUF holding one tensor of `kind` with random blocks (random bytes, with sane float16
    scales): gguf's reader's record of it, and `gguf_file`'s."""
    values, size, floats = K_QUANTS[kind]
    rng = np.random.default_rng(int(kind))
    raw = rng.integers(0, 256, (rows, KQ // values, size), dtype=np.uint8)
    for at in floats:
        scale = rng.uniform(1e-3, 2e-2, (rows, KQ // values)).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(rows, KQ // values, 2)
    path = tmp_path / f"{kind.name}.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", raw.reshape(rows, -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path).tensors[0], gguf_file.read(path).tensors["w"]


# block type -> the groups it becomes and their bytes: K-quants' sub-blocks as groups of their own
# width (Q6_K's pairs of sub-blocks of 16, a d for each half; Q3_K's and Q2_K's, an integer scale
# for each half, its two bytes after the values), IQ4's level indices as stored
GROUPS = {
    T.Q4_K: (int4_gemm.Bits.INT4, 16),
    T.Q5_K: (int4_gemm.Bits.INT5, 20),
    T.Q6_K: (int4_gemm.Bits.INT6, 24),
    T.Q3_K: (int4_gemm.Bits.INT3, 14),
    T.Q2_K: (int4_gemm.Bits.INT2, 10),
    T.IQ4_NL: (int4_gemm.Bits.IQ4, 16),
    T.IQ4_XS: (int4_gemm.Bits.IQ4, 16),
}


@pytest.mark.parametrize("kind", list(GROUPS))
def test_super_blocks_become_groups_of_their_width_within_float16_rounding(tmp_path, kind):
    """Each sub-block of 32 (Q6_K, Q3_K, Q2_K: pair of 16) is one group of the type's width, its
    values as stored (reordered), its scale (d sc, or d times IQ4_XS's scale - 32) and
    Q4_K/Q5_K's offset -dmin mn rounded once to float16, the kernel's scale type; IQ4_NL's
    stored d, and Q3_K's and Q2_K's d (and dmin) beside each half's integer scale (and min), as
    stored: gguf's values bit for bit. Bits a weight: Q6_K 7 (8-bit groups took 8.5); Q3_K 4
    (the file 3.44; 6-bit groups took 7) and Q2_K 3.5 (the file 2.625; 8-bit groups took 8.5),
    `rows` reads the same values as the whole."""
    tensor, info = _k_quant_tensor(tmp_path, kind)
    q, d, m, bits = gguf_weights.blocks(info)
    assert (bits, q.shape[2]) == GROUPS[kind] and q.shape[:2] == (24, KQ // 32)
    packed = int4_gemm.PackedGroups.from_blocks(q, d, m, KQ, bits)
    got, want = packed.dequantize(), _dequantized(tensor)
    if kind in (T.IQ4_NL, T.Q3_K, T.Q2_K):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-10, atol=2**-10 * float(want.abs().max()))
    ids = torch.tensor([0, 5, 23])
    assert torch.equal(packed.rows(ids), got[ids])
    bits_a_weight = {T.Q6_K: 7, T.Q3_K: 4, T.Q2_K: 3.5}
    if kind in bits_a_weight:
        assert packed.nbytes * 8 / (24 * KQ) == bits_a_weight[kind]


def test_super_blocks_are_converted_a_few_rows_at_a_time(tmp_path, monkeypatch):
    """Super-blocks convert in chunks of rows (here of 3): the same groups as at once."""
    info = _k_quant_tensor(tmp_path, T.Q6_K)[1]
    whole = gguf_weights.blocks(info)
    monkeypatch.setattr(gguf_weights, "CONVERT_BYTES", 3 * info.n_bytes // 24)
    chunked = gguf_weights.blocks(info)
    assert all(torch.equal(a, b) for a, b in zip(whole[:2], chunked[:2]))


def test_a_cached_conversion_follows_its_file_to_a_new_place(tmp_path, monkeypatch):
    """A conversion is shared by content: when the file it was made from is gone (a test's
    temporary copy, another virtualenv's wheel), loading the same content from elsewhere
    points its marker there, so the packed blocks are read from a file that exists."""
    from radixrt.executor.model_loader import (
        READY_MARKER,
        _marker,
        conversion_folder,
        convert_gguf,
        converted_from,
        file_digest,
    )

    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(64))
    out = conversion_folder(first)
    out.mkdir(parents=True)
    (out / READY_MARKER).write_text(_marker(first, file_digest(first)))
    assert converted_from(out) == first.resolve()
    first.unlink()
    assert converted_from(out) is None
    assert convert_gguf(second) == out  # the cached copy, not converted again
    assert converted_from(out) == second.resolve()


def test_files_that_share_their_first_megabytes_and_size_share_no_cache(tmp_path, monkeypatch):
    """Conversions (and the packed groups kept in them) are keyed by the whole content: two
    files alike in their first 8 MiB and their size, unlike after, get two folders; a source
    changed in place after its conversion is no longer taken as the folder's source."""
    from radixrt.executor.model_loader import conversion_folder, file_digest

    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    head = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(head + b"\x00" * 4096)
    two.write_bytes(head + b"\x01" * 4096)
    assert one.stat().st_size == two.stat().st_size
    assert conversion_folder(one).name.split("-")[-2] != conversion_folder(two).name.split("-")[-2]
    digest = file_digest(one)
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 2  # hashed once each
    with open(one, "r+b") as f:  # changed in place: same inode and size
        f.seek(len(head))
        f.write(b"\x02")
    assert file_digest(one) != digest
