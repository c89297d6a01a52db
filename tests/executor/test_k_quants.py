"""K-quant GGUF files served packed. The default model's GGUF is written again with K-quants
by the small quantizers below (gguf-py only dequantizes them): a K-quant row is a multiple of
256 values and the model's width (576) is not, so, as llama.cpp would, only the down
projections (1536 wide) take them, Q6_K on even layers and Q4_K on odd ones, as Q4_K_M
alternates; every v projection becomes Q8_0 beside its layer's Q4_1 q and k, so q/k/v stack in
mixed widths. Under `--quantization gguf` every linear is packed (none falls back to float)
and the model passes int4's quality gates against float32 on the same text."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from radixrt.config import ServerArgs
from radixrt.executor.model_loader import default_gguf_path
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import int4_gemm
from radixrt.models.linear import GroupedLinear

from helpers import quality_gates

pytestmark = [
    pytest.mark.skipif(not int4_gemm.available(), reason="int4 needs AVX2 and a compiler"),
    pytest.mark.model,  # the default model
]


def q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q4_K bytes [N, K/256*144]: per sub-block of 32 its [min, max] in 16
    levels, scales and mins as 6-bit multiples of the super-block's float16 d and dmin."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, offset = (high - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    sc = _levels(scale, d, 63)
    mn = _levels(offset, dmin, 63)
    step = d.astype(np.float32)[..., None] * sc
    base = dmin.astype(np.float32)[..., None] * mn
    safe = np.where(step == 0, 1, step)
    q = np.clip(np.rint((x + base[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4),
        ],
        axis=-1,
    )
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    blocks = [_f16_bytes(d), _f16_bytes(dmin), scales, qs]
    return np.concatenate(blocks, axis=-1).reshape(n, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> Q6_K bytes [N, K/256*210]: per sub-block of 16 a signed 6-bit grid
    whose step is an int8 multiple of the super-block's float16 d."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)
    sc = _levels(scale, d, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    safe = np.where(step == 0, 1, step)
    q = (np.clip(np.rint(x / safe[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)  # halves of 128, their quarters of 32
    ql = np.concatenate(
        [
            q[..., 0, :] & 0xF | (q[..., 2, :] & 0xF) << 4,
            q[..., 1, :] & 0xF | (q[..., 3, :] & 0xF) << 4,
        ],
        axis=-1,
    ).reshape(n, k // 256, 128)
    qh = (
        (q[..., 0, :] >> 4)
        | (q[..., 1, :] >> 4) << 2
        | (q[..., 2, :] >> 4) << 4
        | (q[..., 3, :] >> 4) << 6
    ).reshape(n, k // 256, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1).reshape(n, -1)


def _levels(value: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """`value` [..., S] as integer multiples (0..top) of its super-block's float16 `unit`."""
    u = unit.astype(np.float32)[..., None]
    return np.clip(np.rint(value / np.where(u == 0, 1, u)), 0, top).astype(np.uint8)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _q8_0(w: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(w, T.Q8_0)


def _kind(name: str) -> T | None:
    """The type a tensor of the default model gets here (None: kept as it is)."""
    if name.endswith("attn_v.weight"):
        return T.Q8_0
    if name.endswith("ffn_down.weight"):
        return T.Q6_K if int(name.split(".")[1]) % 2 == 0 else T.Q4_K
    return None


@pytest.mark.parametrize("quantize, kind, size", [(q4_k, T.Q4_K, 32), (q6_k, T.Q6_K, 16)])
def test_the_test_quantizers_round_trip_through_ggufs_reader(quantize, kind, size):
    """What the quantizers write, gguf dequantizes to within one step of each sub-block's grid
    (its span over 15 levels for Q4_K, its largest magnitude over 31 for Q6_K)."""
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(w), kind).reshape(8, -1, size)
    sub = w.reshape(8, -1, size)
    if kind == T.Q4_K:
        step = (np.maximum(sub.max(-1), 0) - np.minimum(sub.min(-1), 0)) / 15
    else:
        step = np.abs(sub).max(-1) / 31
    assert (np.abs(back - sub).max(-1) <= step * 1.01).all()


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """The default model's GGUF as a K-quant file (its metadata and other tensors copied)."""
    reader = gguf.GGUFReader(default_gguf_path())
    path = tmp_path_factory.mktemp("k-quants") / "smollm2-k-quants.gguf"
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        kind = _kind(tensor.name)
        if kind is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = {T.Q4_K: q4_k, T.Q6_K: q6_k, T.Q8_0: _q8_0}[kind](w)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_k_quant_file_is_served_packed_within_the_int4_gates(k_quant_file, quality_reference):
    args = ServerArgs(model=str(k_quant_file), quantization="gguf", max_total_tokens=1024)
    runner = ModelRunner(args.executor)
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear)]
    layers = runner.config.num_hidden_layers
    assert len(linears) == 4 * layers + 1  # every linear packed, the output projection too
    widths = [m.weight.bits for m in linears[:-1]]
    # q/k/v hold a Q8_0 v: 8-bit; o, gate/up: 4-bit; down: 6-bit (Q6_K, as stored) on even
    # layers, 4-bit (Q4_K) on odd ones
    assert widths.count(int4_gemm.Bits.INT8) == layers
    assert widths.count(int4_gemm.Bits.INT6) == (layers + 1) // 2
    ratio, agreement = quality_gates(quality_reference, runner, "K-quants")
    assert abs(ratio - 1) <= 0.05
    assert agreement >= 0.90
