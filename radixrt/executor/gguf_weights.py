"""A GGUF file's quantized and 16-bit linears read straight into the grouped kernel's packed
layout (`kernels/int4_gemm.py`, groups of 32): serving them holds no float32 copy of those
weights (`--quantization gguf`, and `int4` on a GGUF model, which takes the quantized ones only).

GGUF stores a linear [N, K] as N rows of blocks:
- Q4_0: per 32, a float16 scale d and 16 bytes of nibbles (w = d (q - 8)); Q4_1 adds an offset
  m (w = d q + m); Q8_0: d and 32 signed bytes. Their blocks are copied, never converted.
- Q4_K: per 256, float16 d and dmin, then eight 6-bit scales and mins (12 bytes) for its eight
  sub-blocks of 32, then their nibbles (w = d sc q - dmin mn). Each sub-block becomes one 4-bit
  group with scale d sc and offset -dmin mn, computed once per sub-block and stored as float16
  (the kernel's scale type: within float16's rounding, 2^-11 relative, of gguf's values); the
  nibbles are only reordered.
- Q5_0, Q5_1 (per 32: d, (m,) 4 bytes of high bits, 16 of nibbles) and Q5_K (Q4_K's with 32
  bytes of high bits per 256): 5-bit groups, at their own size, the nibbles as Q4_0's and each
  group's high bits as Q5_0's word (w = d q - 16 d for Q5_0; Q5_1 and Q5_K store m).
- Q6_K (per 256: 6-bit values in sub-blocks of 16, each with an int8 scale of the super-block's
  d): 6-bit groups, a d for each half (d times the sub-block's scale, rounded once to float16,
  as Q4_K's), 7 bits a weight (Q6_K: 6.56).
- Q3_K (per 256: 3-bit signed values -4..3, their low 2 bits and a high bit stored apart, in
  sub-blocks of 16, each with a 6-bit scale - 32 of the super-block's d): 3-bit groups
  (`Bits.INT3`), the values, their high bits and each half's scale - 32 (an int8) moved as
  stored, d beside them: 4 bits a weight (the file: 3.44). The kernel multiplies each half's
  integer sum by its integer scale, exactly, and d once; what they stand for is gguf's
  dequantization bit for bit (its d sc, float16 times a small integer, is exact in float32).
- Q2_K (per 256: 2-bit values in sub-blocks of 16, each with a 4-bit scale and min of the
  super-block's d and dmin): 2-bit groups (`Bits.INT2`), the values and each half's scale byte
  (scale and min) moved as stored, d and dmin beside them: 3.5 bits a weight (the file: 2.625),
  gguf's values bit for bit (w = d (sc q) - dmin mn, each product exact in float32). On a GPU
  (whose Triton kernel reads neither) both become 8-bit groups by Q8_0's rule as they move there
  (`PackedGroups.to`).
- IQ4_NL (per 32: d and 16 bytes of indices into 16 non-uniform int8 levels) and IQ4_XS (per
  256: d, a 6-bit scale per 32, the indices): IQ4 groups, the indices as stored, d (times the
  sub-block's scale - 32, rounded once to float16, for IQ4_XS).
- F16 and BF16 (a converter's `--outtype f16`/`bf16`, or what llama-quantize keeps at 16 bits
  beside quantized tensors): the 16-bit widths, 2 bytes a weight, the values moved into panels
  as stored, never converted; on the CPU and under `gguf` only (`plan`'s `halves`: `int4`
  quantizes them, and a GPU's float linears are 16-bit in its own dtype already).
Tensors stacked into one linear (q/k/v, gate/up) share a width, the widest: 4-bit ones become
5-bit exactly (a file's Q4_K q and k beside a Q5_0 v); beside an 8-bit one (a Q8_0 v), or a
6-, 3- or 2-bit one beside others (a Q4_K_M file's Q6_K v beside Q4_K q and k; a Q3_K_M file's
Q5_K v beside Q3_K q and k), every part becomes 8-bit
groups by Q8_0's rule (at most half an 8-bit step, 1/254 of a group's largest magnitude). A 16-bit
tensor stacks only with tensors of its own type: no width holds its values and a quantized
group's (or the other 16-bit type's) exactly, so such a mix stays float, as before. llama.cpp's
converter reorders the rows of a Llama's q and k projections (the two halves of each
head's rotary pairs interleaved); `_unpermute` puts them back, as transformers does when it
dequantizes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixrt.executor import gguf_families, gguf_file
from radixrt.executor.gguf_file import GGUFFile, TensorInfo
from radixrt.executor.model_loader import SafetensorsWriter, read_into
from radixrt.kernels import int4_gemm
from radixrt.kernels.int4_gemm import (
    GROUP,
    HALF_DTYPES,
    Bits,
    PackedGroups,
    implied_offsets,
    int8_groups,
    six_high_packed,
    three_high_packed,
)
from radixrt.models.linear import EMBEDDING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# GGUF type name -> the width of the groups its blocks (or 16-bit values) become
PACKED_TYPES = {
    "Q4_0": Bits.INT4,
    "Q4_1": Bits.INT4,
    "Q5_0": Bits.INT5,
    "Q5_1": Bits.INT5,
    "Q8_0": Bits.INT8,
    "Q4_K": Bits.INT4,
    "Q5_K": Bits.INT5,
    "Q6_K": Bits.INT6,
    "Q3_K": Bits.INT3,
    "Q2_K": Bits.INT2,
    "IQ4_NL": Bits.IQ4,
    "IQ4_XS": Bits.IQ4,
    "F16": Bits.F16,
    "BF16": Bits.BF16,
}
SUPER = 256  # values in a K-quant super-block
Q4_K_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of nibbles
Q5_K_BYTES = 176  # Q4_K's, with 32 bytes of high bits before the nibbles
Q6_K_BYTES = 210  # 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, float16 d
Q3_K_BYTES = 110  # 32 bytes of high bits, 64 of low 2-bit pairs, 12 of 6-bit scales, float16 d
Q2_K_BYTES = 84  # 16 bytes of 4-bit scales and mins, 64 of 2-bit values, float16 d and dmin
IQ4_XS_BYTES = 136  # float16 d, 16 bits of scales' top bits, 4 bytes of their low ones, nibbles
# super-blocks converted at once: their temporaries (ints of every value) stay tens of MB, where
# a 49152-row Q6_K output projection converted whole peaked 2.8 GB over its 84 MB of groups
CONVERT_BYTES = 2 << 20
# the GGUF architectures whose tensor names and row orders `plan` knows
ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma2",
    "gemma3",
    "lfm2",
    "qwen35",
    "qwen35moe",
    "qwen3next",
    "granitehybrid",
    "falcon-h1",
)
# a stateful mixer's linears by architecture: ours (under the layer) -> the file's (under
# `blk.N.`)
QWEN35_MIXER = {  # the Gated DeltaNet, its value heads in the file's order (`gguf_families`)
    "linear_attn.in_proj_qkv": "attn_qkv.weight",
    "linear_attn.in_proj_z": "attn_gate.weight",
    "linear_attn.in_proj_b": "ssm_beta.weight",
    "linear_attn.in_proj_a": "ssm_alpha.weight",
    "linear_attn.out_proj": "ssm_out.weight",
}
MIXER_LINEARS = {
    "lfm2": {
        "conv.in_proj": "shortconv.in_proj.weight",
        "conv.out_proj": "shortconv.out_proj.weight",
    },
    "qwen35": QWEN35_MIXER,
    "qwen35moe": QWEN35_MIXER,
    # Qwen3-Next's b and a rows interleave in one tensor (`ssm_ba`): served float
    "qwen3next": {
        "linear_attn.in_proj_qkv": "attn_qkv.weight",
        "linear_attn.in_proj_z": "attn_gate.weight",
        "linear_attn.out_proj": "ssm_out.weight",
    },
    "granitehybrid": {"mamba.in_proj": "ssm_in.weight", "mamba.out_proj": "ssm_out.weight"},
    "falcon-h1": {
        "hybrid.mamba.in_proj": "ssm_in.weight",
        "hybrid.mamba.out_proj": "ssm_out.weight",
    },
}
# where a layer's attention lies in radixrt's model, where not at `self_attn` (Falcon-H1's,
# beside its Mamba-2 mixer: `falcon_h1.ParallelMixer`)
ATTENTION = {"falcon-h1": "hybrid.self_attn"}
# a shared expert's linears (Qwen3.5-MoE's, Qwen3-Next's, Granite 4's shared MLP beside its
# experts): ours (under the layer) -> the file's parts
SHARED_EXPERT = {
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp.weight",),
}
# `read_linears`' packed copy, beside the file's config: safetensors under a name that the
# loader's *.safetensors glob (a folder's own float weights) never takes (`packed_cache` adds
# its key)
PACKED_CACHE = ".radixrt-packed-groups"


@dataclass(frozen=True)
class Part:
    """One GGUF tensor that fills rows of a linear, and the heads whose rows the converter
    permuted (0: none)."""

    name: str
    heads: int = 0


@dataclass(frozen=True)
class GGUFPlan:
    """The linears (module name -> parts, stacked by rows) whose every part is of a packed
    type, and the file's tensors (`header`, read once)."""

    header: GGUFFile
    linears: dict[str, list[Part]]
    tensors: dict[str, TensorInfo]  # the file's, and each expert's matrix (`gguf_file.experts`)

    def meta_weights(self, tied: bool) -> frozenset[str]:
        """Parameters never to fill as float: the packed linears' and the embedding's weights
        (packed as its own `EMBEDDING` entry, or, tied, as the output projection)."""
        names = {f"{m}.weight" for m in self.linears}
        if tied and "lm_head" in self.linears:
            names.add(f"{EMBEDDING}.weight")
        return frozenset(names)


def plan(path: Path, config: PretrainedConfig, halves: bool = True) -> GGUFPlan:
    """Which linears of a model of `ARCHITECTURES` (fused q/k/v and gate/up, as `models/layers.py`
    builds them) `path` holds in packed types (the 16-bit ones only with `halves`); none for an
    architecture it cannot map."""
    header = gguf_file.read(path)
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"packed GGUF weights need a {' or '.join(ARCHITECTURES)} GGUF, not {arch}"
        )
    experts = gguf_families.expert_tensors(header).values()
    tensors = {**header.tensors, **{t.name: t for t in experts}}
    types = {name: t.kind.name for name, t in tensors.items()}
    rope = arch == "llama"  # the converter permutes q and k rows of Llama only
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    wanted: dict[str, list[Part]] = {}
    for i in range(config.num_hidden_layers):
        b, me = f"blk.{i}.", f"layers.{i}."
        attention = f"{me}{ATTENTION.get(arch, 'self_attn')}."
        if b + "attn_q.weight" in types:  # else the layer mixes by something else (LFM2's)
            wanted[attention + "qkv_proj"] = [
                Part(b + "attn_q.weight", heads if rope else 0),
                Part(b + "attn_k.weight", kv_heads if rope else 0),
                Part(b + "attn_v.weight"),
            ]
            wanted[attention + "o_proj"] = [Part(b + "attn_output.weight")]
        for ours, theirs in MIXER_LINEARS.get(arch, {}).items():
            if b + theirs in types:
                wanted[me + ours] = [Part(b + theirs)]
        for ours, names in SHARED_EXPERT.items():
            wanted[me + ours] = [Part(b + name) for name in names]
        e = 0  # each expert's matrices, sliced from the tensors of every expert's
        while (gate := gguf_file.expert_name(f"{b}ffn_gate_exps.weight", e)) in types:
            up, down = (gguf_file.expert_name(f"{b}ffn_{p}_exps.weight", e) for p in ("up", "down"))
            wanted[f"{me}mlp.experts.{e}.gate_up_proj"] = [Part(gate), Part(up)]
            wanted[f"{me}mlp.experts.{e}.down_proj"] = [Part(down)]
            e += 1
        wanted[me + "mlp.gate_up_proj"] = [Part(b + "ffn_gate.weight"), Part(b + "ffn_up.weight")]
        wanted[me + "mlp.down_proj"] = [Part(b + "ffn_down.weight")]
    wanted["lm_head"] = [Part("output.weight" if "output.weight" in types else "token_embd.weight")]
    if not getattr(config, "tie_word_embeddings", False):  # tied, it is the output projection's
        wanted[EMBEDDING] = [Part("token_embd.weight")]
    linears = {
        m: parts
        for m, parts in wanted.items()
        if _packable([types.get(p.name) for p in parts], halves)
    }
    return GGUFPlan(header, linears, tensors)


def packed_cache(folder: Path) -> Path:
    """Where `read_linears` keeps the packed copy of the GGUF that `folder` was converted from:
    named by the code that packs (this module and the kernel's layout, `int4_gemm`), so an edit
    to either packs again rather than reading groups of another layout."""
    digest = hashlib.sha256()
    for module in (__file__, int4_gemm.__file__):
        digest.update(Path(module).read_bytes())
    return folder / f"{PACKED_CACHE}-{digest.hexdigest()[:12]}"


def read_linears(plan: GGUFPlan, cache: Path | None = None) -> dict[str, PackedGroups]:
    """Every planned linear, packed from the file's blocks. With `cache` (a file beside the
    model's conversion, which is keyed by the GGUF's content), the packed groups are read from
    it when it holds exactly the planned linears, else packed and written there: repacking
    K-quants and requantizing Q5_K/Q6_K takes seconds at 1.1B (most of a start), reading their
    result back a fraction of one, and the bits are the same. Writing one removes the copies
    an older layout left beside it (each as large as the model's linears)."""
    if cache is not None and cache.is_file():
        cached = _read_cache(cache)
        if cached.keys() == plan.linears.keys():
            return cached
    tensors = plan.tensors
    packed = {
        module: _stack([tensors[p.name] for p in parts], parts)
        for module, parts in plan.linears.items()
    }
    if cache is not None:
        _write_cache(packed, cache)
        for stale in cache.parent.glob(f"{PACKED_CACHE}*"):
            if stale != cache and ".tmp" not in stale.name:  # another writer's, in progress
                stale.unlink(missing_ok=True)
    return packed


def _write_cache(packed: dict[str, PackedGroups], cache: Path) -> None:
    """`packed` as safetensors (each linear's tiles and scales; its shape and width in the
    metadata), written under a temporary name and renamed: a reader sees all of it or none."""
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    shapes = {m: f"{w.out_features},{w.in_features},{int(w.bits)}" for m, w in packed.items()}
    with SafetensorsWriter(tmp, 2 * len(packed), shapes) as writer:
        for module, weight in packed.items():
            writer.add(f"{module}.tiles", weight.tiles)
            writer.add(f"{module}.scales", weight.scales)
    os.replace(tmp, cache)


def _read_cache(cache: Path) -> dict[str, PackedGroups]:
    """What `_write_cache` wrote."""
    from safetensors import safe_open

    with safe_open(cache, framework="pt") as f:
        shapes = {k: v for k, v in f.metadata().items() if k != "format"}
        packed = {}
        for module, shape in shapes.items():
            out, in_, bits = (int(n) for n in shape.split(","))
            tiles, scales = f.get_tensor(f"{module}.tiles"), f.get_tensor(f"{module}.scales")
            packed[module] = PackedGroups(tiles, scales, out, in_, Bits(bits))
    return packed


def _raw(tensor: TensorInfo) -> torch.Tensor:
    """A tensor's bytes as the file stores them, uint8 [n_bytes]."""
    raw = torch.empty(tensor.n_bytes, dtype=torch.uint8)
    with open(tensor.path, "rb", buffering=0) as f:
        read_into(f.fileno(), raw, tensor.offset, f.name)
    return raw


def _half_rows(tensor: TensorInfo) -> torch.Tensor:
    """An F16 or BF16 tensor's rows [N, K] in its dtype, as stored."""
    k, n = tensor.shape
    return _raw(tensor).view(HALF_DTYPES[PACKED_TYPES[tensor.kind.name]]).view(n, k)


def blocks(tensor: TensorInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Bits]:
    """A packed-type GGUF tensor's rows as groups of 32: values [N, G, group bytes] (nibbles in
    Q4_0's order, or int8 viewed as uint8), d and m float16 [N, G] (m None for the symmetric
    forms, Q4_0 and 8-bit groups: their offsets are implied; 6-bit groups: d [N, G, 2], each
    half's; Q3_K's and Q2_K's groups: the halves' scale bytes after the values, m Q2_K's dmin),
    and their width. Super-blocks are converted `CONVERT_BYTES` at a time."""
    kind = tensor.kind.name
    raw = _raw(tensor)
    k, n = tensor.shape
    bits = PACKED_TYPES[kind]
    if kind in SUPER_BLOCKS:
        size, convert = SUPER_BLOCKS[kind]
        blocks = raw.view(n, k // SUPER, size)
        step = max(1, CONVERT_BYTES // blocks[0].nbytes)  # rows a chunk
        chunks = [convert(blocks[i : i + step]) for i in range(0, n, step)]
        joined = [torch.cat(parts) for parts in zip(*chunks)]
        return joined[0], joined[1], joined[2] if len(joined) > 2 else None, bits
    offsets = kind in ("Q4_1", "Q5_1")  # Q4_0, Q5_0, Q8_0, IQ4_NL: d and the values
    head = 4 if offsets else 2  # the bytes before the values: d, or d and m
    raw = raw.view(n, k // GROUP, head + bits.group_bytes)
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0]
    # Q4_0's -8 d, Q5_0's -16 d and Q8_0's 0: implied (`implied_offsets`), not stored
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0] if offsets else None
    q = raw[..., head:]
    if bits == Bits.INT5:  # GGUF stores the high bits first, the groups hold them last
        q = torch.cat([q[..., 4:], q[..., :4]], dim=-1)
    return q, d, m, bits


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's super-blocks [N, S, bytes] -> their sub-blocks' scales d sc and
    offsets -dmin mn, float16 [N, 8S] (within float16's rounding of gguf's float32 values)."""
    n, s, _ = raw.shape
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # [N, S, 1]
    dmin = raw[..., 2:4].contiguous().view(torch.float16).float()
    b = raw[..., 4:16].to(torch.int32)
    # llama.cpp's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales)
    # and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their top 2 bits in bytes 0-7's
    scales = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], -1)
    mins = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return (d * scales).view(n, s * 8).half(), (-(dmin * mins)).view(n, s * 8).half()


def _nibbles(values: torch.Tensor) -> torch.Tensor:
    """Groups' values [..., 32] (their low 4 bits) as 16 bytes in Q4_0's order: byte j holds
    values j and j + 16."""
    return (values[..., :16] & 0xF) | ((values[..., 16:] & 0xF) << 4)


def _six_bit(values: torch.Tensor) -> torch.Tensor:
    """6-bit groups' values 0..63 uint8 [N, G, 32] -> their 24 bytes: the nibbles, then the top
    2 bits as `int4_gemm.six_high` holds them."""
    return torch.cat([_nibbles(values), six_high_packed(values >> 4)], dim=-1).contiguous()


def _two_bit_quarters(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 2-bit fields [N, S, 64] -> [N, 8S, 32]: each half of a super-block is 32
    bytes whose bit pairs 2j hold its sub-blocks' quarter j (llama.cpp's dequantize_row_q2_K)."""
    n, s, _ = qs.shape
    shifts = (2 * torch.arange(4, dtype=torch.uint8))[:, None]
    return ((qs.reshape(n, s, 2, 1, 32) >> shifts) & 3).reshape(n, s * 8, GROUP)


def _k_values(qs: torch.Tensor) -> torch.Tensor:
    """K-quant nibbles [N, S, 128] (each 32 bytes hold two sub-blocks: the low nibbles, then
    the high) -> each sub-block's 32 values [N, 8S, 32]."""
    n, s, _ = qs.shape
    pairs = qs.reshape(n, s, 4, 1, 32)
    return torch.cat([pairs & 0xF, pairs >> 4], dim=3).view(n, s * 8, GROUP)


def _q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks [N, S, 144] -> nibbles [N, 8S, 16] in Q4_0's order (byte j holds
    values j and j + 16 of its group), scales d sc and offsets -dmin mn float16 [N, 8S]."""
    return (_nibbles(_k_values(raw[..., 16:])).contiguous(), *_k_scales(raw))


def _q5_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K super-blocks [N, S, 176] -> 5-bit groups [N, 8S, 20] (Q4_K's nibbles, then each
    group's 32 high bits: bit l of its word is value l's), scales and offsets as Q4_K's. A
    super-block's 32 bytes of high bits hold sub-block j's in bit j of byte l (value l)."""
    n, s, _ = raw.shape
    nibbles = _nibbles(_k_values(raw[..., 48:]))
    qh = raw[..., 16:48].to(torch.int64)  # [N, S, 32]: byte l, bit j
    bits = (qh[..., None, :] >> torch.arange(8)[:, None]) & 1  # [N, S, 8 sub-blocks, 32]
    words = (bits << torch.arange(32)).sum(-1)  # [N, S, 8]: bit l = value l's
    qh_bytes = ((words[..., None] >> torch.arange(0, 32, 8)) & 0xFF).to(torch.uint8)
    q = torch.cat([nibbles, qh_bytes.view(n, s * 8, 4)], dim=-1)
    return (q.contiguous(), *_k_scales(raw))


def _iq4_xs(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS super-blocks [N, S, 136] -> IQ4 groups [N, 8S, 16] (each sub-block's 16 bytes of
    level indices, already in Q4_0's pairing) and their d float16 [N, 8S]: the super-block's d
    times (its 6-bit scale - 32), rounded once to float16 (as K-quants' scales). Sub-block j's
    scale: the nibble j % 2 of byte j / 2 of the low bits, over bits 2j of the 16-bit top."""
    n, s, _ = raw.shape
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # [N, S, 1]
    top = raw[..., 2:4].to(torch.int32)
    top = top[..., 0:1] | (top[..., 1:2] << 8)  # [N, S, 1]
    low = raw[..., 4:8].to(torch.int32).repeat_interleave(2, dim=-1)  # [N, S, 8]
    j = torch.arange(8, dtype=torch.int32)
    scale = ((low >> (4 * (j % 2))) & 0xF) | (((top >> (2 * j)) & 3) << 4)
    q = raw[..., 8:].reshape(n, s * 8, 16)
    return q.contiguous(), (d * (scale - 32)).half().reshape(n, s * 8)


def _q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [N, S, 210] -> 6-bit groups [N, 8S, 24] (each group's nibbles in Q4_0's
    order, then its top 2 bits as `int4_gemm.six_high` holds them) and each half's d float16
    [N, 8S, 2]: d times the int8 scale of its sub-block of 16, rounded once to float16 (the
    kernel's scale type, as Q4_K's). Value l of a super-block half's 128 (llama.cpp's
    dequantize_row_q6_K): its low 4 bits from byte l % 64 of the half's 64 bytes of nibbles
    (low nibble for l < 64), its top 2 from byte l % 32 of the half's 32 bytes, bits 2 (l / 32);
    the stored value is that minus 32."""
    n, s, _ = raw.shape
    ql = raw[..., :128].reshape(n, s, 2, 2, 32)  # [N, S, half, first or second 32 bytes, l]
    qh = raw[..., 128:192].reshape(n, s, 2, 1, 32)
    low = torch.stack(
        [ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], 3
    )
    top = (qh >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3  # [N, S, half, 4, 32]
    values = (low | (top << 4)).reshape(n, s * 8, GROUP)
    scales = raw[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    d = raw[..., 208:210].contiguous().view(torch.float16).float()  # [N, S, 1]
    return _six_bit(values), (d * scales).half().reshape(n, s * 8, 2)


def _super_d(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each super-block [N, S, bytes] (d, dmin), for each of its
    groups: [N, 8S]."""
    n, s, _ = raw.shape
    return raw[..., at : at + 2].contiguous().view(torch.float16).expand(n, s, 8).reshape(n, s * 8)


def _q3_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K super-blocks [N, S, 110] -> INT3 groups [N, 8S, 14] (the 2-bit fields as
    `int4_gemm.six_high` holds them, the high bits as `int4_gemm.three_high`, then the halves'
    scales - 32 as int8) and the super-block's d float16 [N, 8S]: every value and scale as
    stored, only moved. Value l of group g (llama.cpp's dequantize_row_q3_K): the 2-bit quarter
    as Q2_K's, less 4 where bit g of high-bit byte l is clear. The 16 scales: the nibbles of
    bytes 0-7 (low nibbles first), over the bit pairs of bytes 8-11 (pair 0 for scales 0-3,
    then 4-7, 8-11, 12-15)."""
    n, s, _ = raw.shape
    low = _two_bit_quarters(raw[..., 32:96])
    high = (raw[..., :32].reshape(n, s, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    b = raw[..., 96:108].to(torch.int32)
    nibbles = torch.cat([b[..., 0:8] & 0xF, b[..., 0:8] >> 4], -1)  # scales' low 4 bits
    tops = torch.cat([(b[..., 8:12] >> (2 * i)) & 3 for i in range(4)], -1)
    scales = ((nibbles | (tops << 4)) - 32).to(torch.int8).view(torch.uint8)
    q = torch.cat(
        [
            six_high_packed(low),
            three_high_packed(high.reshape(n, s * 8, GROUP)),
            scales.reshape(n, s * 8, 2),
        ],
        dim=-1,
    )
    return q, _super_d(raw, 108)


def _q2_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K super-blocks [N, S, 84] -> INT2 groups [N, 8S, 10] (the 2-bit fields as
    `int4_gemm.six_high` holds them, then the halves' scale bytes as stored: scale in the low
    nibble, min in the high), the super-block's d and dmin float16 [N, 8S] (llama.cpp's
    dequantize_row_q2_K: sub-block i of 16 is d (scale i & 15) q - dmin (scale i >> 4))."""
    n, s, _ = raw.shape
    fields = six_high_packed(_two_bit_quarters(raw[..., 16:80]))
    q = torch.cat([fields, raw[..., :16].reshape(n, s * 8, 2)], dim=-1)
    return q, _super_d(raw, 80), _super_d(raw, 82)


# K-quant (and IQ4_XS) type -> (bytes a super-block, its rows' conversion into groups)
SUPER_BLOCKS: dict[str, tuple[int, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]] = {
    "Q4_K": (Q4_K_BYTES, _q4_k),
    "Q5_K": (Q5_K_BYTES, _q5_k),
    "Q6_K": (Q6_K_BYTES, _q6_k),
    "Q3_K": (Q3_K_BYTES, _q3_k),
    "Q2_K": (Q2_K_BYTES, _q2_k),
    "IQ4_XS": (IQ4_XS_BYTES, _iq4_xs),
}


def _stack(tensors: list[TensorInfo], parts: list[Part]) -> PackedGroups:
    """Several tensors' rows, one after the other, as one packed weight of the widest width
    (the module's docstring: 4-bit beside 5-bit widens exactly, any other mix to 8-bit groups).
    A tensor alone, in its own order (the output projection, the embedding: the largest), is
    not copied on the way (each copy of the largest is the load's peak). 16-bit tensors stack
    only with their own type (`_packable`)."""
    k = tensors[0].shape[0]
    widths = {PACKED_TYPES[t.kind.name] for t in tensors}
    if widths & HALF_DTYPES.keys():
        rows = [_half_rows(t) for t in tensors]
        rows = [r[_unpermute(len(r), p.heads)] if p.heads else r for r, p in zip(rows, parts)]
        return PackedGroups.from_halves(_joined(rows))
    if len(widths) == 1:
        bits = widths.pop()
    elif widths == {Bits.INT4, Bits.INT5}:  # 4-bit groups become 5-bit exactly
        bits = Bits.INT5
    else:  # no other width holds another's groups exactly
        bits = Bits.INT8
    qs, ds, ms = [], [], []
    for tensor, part in zip(tensors, parts):
        q, d, m, width = blocks(tensor)
        if width != bits:
            q, d, m = _widened(q, d, m, k, width, bits)
        if part.heads:
            order = _unpermute(q.shape[0], part.heads)
            q, d, m = q[order], d[order], None if m is None else m[order]
        qs.append(q)
        ds.append(d)
        ms.append(m)
    m_all = None  # stored only where some part has offsets of its own (Q4_1 beside Q4_0)
    if any(m is not None for m in ms):
        m_all = _joined([implied_offsets(d, bits) if m is None else m for m, d in zip(ms, ds)])
    return PackedGroups.from_blocks(_joined(qs), _joined(ds), m_all, k, bits)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Parts' rows one after the other; a part alone as it is (no copy of the largest tensor)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _widened(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, k: int, width: Bits, bits: Bits
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Groups of `width` as groups of `bits`, wider: 4-bit as 5-bit exactly (no high bits; the
    offsets kept, Q4_0's implied -8 d stored), else as 8-bit within half an 8-bit step (one
    tensor's floats at a time)."""
    if bits == Bits.INT5:
        m = implied_offsets(d, width) if m is None else m
        return torch.cat([q, q.new_zeros(*q.shape[:-1], 4)], dim=-1), d, m
    w = PackedGroups.from_blocks(q, d, m, k, width).dequantize()
    q8, d8 = int8_groups(w.view(w.shape[0], -1, GROUP))
    return q8.view(torch.uint8), d8, None


def _packable(kinds: list[str | None], halves: bool) -> bool:
    """Whether tensors of these GGUF types stack into one packed weight: all of quantized packed
    types, or, with `halves`, all of one 16-bit type (the module's docstring)."""
    widths = {PACKED_TYPES.get(k or "") for k in kinds}
    if None in widths:
        return False
    if widths & HALF_DTYPES.keys():
        return halves and len(widths) == 1
    return True


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation over `heads` heads (0: the identity):
    its row (head, i, half) is Hugging Face's (head, half, i)."""
    index = torch.arange(rows)
    if heads == 0:
        return index
    return index.view(heads, -1, 2).transpose(1, 2).reshape(-1)
