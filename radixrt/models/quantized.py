"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) read straight into the CPU kernels'
packed layouts: their integer weights are moved, never dequantized to float (FP8 aside: see
below), so a load holds the packed weights and one linear's integers at a time. On a CUDA GPU
the same packed tensors are moved to the device and multiplied by the Triton kernel
(`kernels/packed_gemm.py`), which reads that layout as stored.

Every grouped format stores `w[n, k] = s[n, g] * (q[n, k] - z[n, g])`, with `g` the group of
input `k`; what differs is how q, s, z and the groups are laid out:
- GPTQ (AutoGPTQ/GPTQModel, `checkpoint_format` gptq or gptq_v2): `qweight` int32 [K*b/32, N],
  inputs packed down a column (input 32i/b + j in bits b*j of word i); `qzeros` int32
  [G, N*b/32], outputs packed along a row; `scales` float16 [G, N]; `g_idx` int32 [K], the
  group of each input (act-order, `desc_act`: not monotone). The v1 format stores z - 1.
- AWQ (AutoAWQ's GEMM layout): `qweight` int32 [K, N/8], outputs packed along a row in the order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds output 8c + AWQ_ORDER[i]); `qzeros` [G, N/8] the same
  way; `scales` [G, N]; groups are contiguous.
- compressed-tensors `pack-quantized` (llm-compressor's W4A16/W8A16): `weight_packed` int32
  [N, K*b/32], inputs packed along a row, each value stored plus 2^(b-1); `weight_scale`
  [N, G]; asymmetric ones `weight_zero_point` int32 [N*b/32, G] (packed down a column, with the
  same offset); `weight_g_idx` [K] with `actorder: group`.

Each becomes `int4_gemm.PackedGroups`: groups of 32 inputs, `w = d q + m`. A group of g >= 32
inputs (g a multiple of 32, or -1: one per output channel) is g/32 of ours, each with d = s and
m = -s z (8-bit: q - 128 as int8, m = s (128 - z)); d and m are float16 (within 2^-11 of
s and s z: far below half a step). Act-order inputs are sorted by group once at load (a stable
sort), so each group is contiguous; the module then takes its activations in that order
(`GroupedLinear`'s `perm`: one gather per call).

compressed-tensors `int-quantized` (W8A8: int8 weights, one scale per output channel,
symmetric) is `int8_gemm.PackedInt8` as stored; its dynamic per-token int8 activations are
our int8 kernel's own (per row, finer: int16). `float-quantized` (FP8 e4m3 weights, one scale
per channel or tensor) is requantized at load, a few rows at a time, to int8 per channel (the
CPU has no FP8 arithmetic): within half an int8 step, 1/254 of each row's largest magnitude.

What cannot be honoured is refused in one line naming it (`CheckpointQuant.of`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from radixrt.kernels import int8_gemm
from radixrt.kernels.int4_gemm import GROUP, Bits, PackedGroups
from radixrt.models.interface import WeightSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig

METHODS = ("awq", "compressed-tensors", "gptq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output 8c + AWQ_ORDER[i] is in nibble i of word c
FP8_ROWS_BYTES = 4 << 20  # float32 bytes of FP8 rows requantized at a time


@dataclass(frozen=True)
class Scheme:
    """How one linear's weights are stored: `layout` (gptq, gptq_v2, awq, pack, int8, fp8),
    bits, inputs per scale (`group`, 0: one scale per output channel or per tensor) and whether
    the zero point is implied (`symmetric`)."""

    layout: str
    bits: int
    group: int
    symmetric: bool

    def describe(self) -> str:
        kind = "fp8" if self.layout == "fp8" else f"int{self.bits}"
        groups = f"g{self.group}" if self.group else "per-channel"
        into = "int8 per channel" if self.layout in ("int8", "fp8") else "groups of 32"
        sym = "sym" if self.symmetric else "asym"
        return f"{kind} {groups} {sym} -> {into}"


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's `quantization_config`, checked: the method, each group of targets'
    `Scheme` (gptq and awq: one, for every linear they hold packed), the modules left float
    (`ignore`) and whether GPTQ says act-order (`desc_act`: then every linear needs its g_idx)."""

    method: str
    schemes: tuple[tuple[tuple[str, ...], Scheme], ...]
    ignore: tuple[str, ...] = ()
    desc_act: bool = False

    @classmethod
    def of(cls, config: PretrainedConfig) -> CheckpointQuant | None:
        """The config's quantization, or None for a float checkpoint; ValueError, one line
        naming the field, for what radixrt cannot serve as stored."""
        quant = getattr(config, "quantization_config", None)
        if not quant:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        method = quant.get("quant_method")
        if method == "gptq":
            return _gptq(quant)
        if method == "awq":
            return _awq(quant)
        if method == "compressed-tensors":
            return _compressed_tensors(quant)
        raise _refuse(method, f"quant_method {method!r}", f"supported: {', '.join(METHODS)}")

    def describe(self) -> str:
        """The quantization path, for `model_info` and the start-up log."""
        schemes = sorted({s.describe() for _, s in self.schemes})
        act = " act-order" if self.desc_act else ""
        return f"{self.method}{act}: {'; '.join(schemes)}"

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a packed weight reads (the widest scheme's): 4-bit groups 0.625, 8-bit groups
        1.125 (a group's float16 d and m beside its values), int8 per channel 1."""
        widths = [
            1.0 if s.layout in ("int8", "fp8") else (s.bits * GROUP / 8 + 4) / GROUP
            for _, s in self.schemes
        ]
        return max(widths)

    def scheme(self, module: str) -> Scheme | None:
        """The scheme of a checkpoint module (its Hugging Face name), None where it stays float."""
        if any(_matches(module, target) for target in self.ignore):
            return None
        for targets, scheme in self.schemes:
            if any(_matches(module, target) for target in targets):
                return scheme
        return None

    def holds(self, names: set[str], module: str) -> bool:
        """Whether the checkpoint holds `module`'s weight quantized (by its tensors' names)."""
        return any(
            f"{module}.{suffix}" in names for suffix in ("qweight", "weight_packed", "weight_scale")
        )

    def read(self, source: WeightSource, names: set[str], modules: list[str]) -> Packed:
        """The linears `modules` (their rows one after the other: q/k/v, gate/up) as one packed
        weight, from `source`, whose tensors are `names`; ValueError where they cannot share
        one (different schemes or act-orders)."""
        schemes = {self.scheme(m) for m in modules}
        if None in schemes:
            raise ValueError(f"{modules}: quantized tensors where quantization_config says float")
        scheme = schemes.pop()
        if schemes or scheme is None:
            raise ValueError(f"{modules} are stored in different quantization schemes")
        if scheme.layout in ("int8", "fp8"):
            parts = [_channel_ints(source, m, scheme) for m in modules]
            q = torch.cat([p[0] for p in parts])
            scales = torch.cat([p[1] for p in parts])
            return int8_gemm.PackedInt8(int8_gemm.pack(q), scales, q.shape[0], q.shape[1])
        ints = [_group_ints(source, names, m, scheme, self.desc_act) for m in modules]
        return _to_groups(_stack(ints, modules), scheme.bits)


@dataclass(frozen=True)
class PermutedGroups:
    """Grouped weights whose inputs are stored sorted by group (GPTQ's act-order): input j of
    `weight` is input `perm[j]` of the layer."""

    weight: PackedGroups
    perm: torch.Tensor

    def to(self, device: torch.device) -> PermutedGroups:
        return PermutedGroups(self.weight.to(device), self.perm.to(device))


Packed: TypeAlias = PackedGroups | PermutedGroups | int8_gemm.PackedInt8


@dataclass
class GroupInts:
    """One linear's grouped integers: w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]), g =
    `groups[k]`; q uint8 [N, K] (unsigned), scale float32 and zero float32 [N, G]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    groups: torch.Tensor  # int64 [K]


# ---- the config --------------------------------------------------------------------------
def _refuse(method: str | None, field: str, why: str) -> ValueError:
    return ValueError(
        f"config.json: quantization_config ({method}) {field} is not supported ({why})"
    )


def _bits(method: str, bits: Any, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise _refuse(method, f"bits {bits}", f"radixrt serves {' and '.join(map(str, allowed))}")
    return int(bits)


def _group(method: str, size: Any) -> int:
    """Inputs per scale: a multiple of 32 (radixrt's groups), or -1/None: per output channel."""
    if size in (-1, None, 0):
        return 0
    if not isinstance(size, int) or size <= 0 or size % GROUP:
        raise _refuse(method, f"group_size {size}", f"a multiple of {GROUP} or -1")
    return size


def _gptq(quant: dict[str, Any]) -> CheckpointQuant:
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise _refuse("gptq", f"checkpoint_format {fmt!r}", f"supported: {', '.join(GPTQ_FORMATS)}")
    if quant.get("dynamic"):
        raise _refuse("gptq", "dynamic (per-module overrides)", "one scheme for every linear")
    bits = _bits("gptq", quant.get("bits"), (4, 8))
    scheme = Scheme(
        fmt, bits, _group("gptq", quant.get("group_size")), bool(quant.get("sym", True))
    )
    skip = tuple(quant.get("modules_to_not_convert") or ())
    return CheckpointQuant("gptq", ((("Linear",), scheme),), skip, bool(quant.get("desc_act")))


def _awq(quant: dict[str, Any]) -> CheckpointQuant:
    version = str(quant.get("version") or quant.get("backend") or "gemm").lower()
    if version != "gemm":
        raise _refuse("awq", f"version {version!r}", "radixrt reads the GEMM layout")
    if quant.get("zero_point") is False:
        raise _refuse("awq", "zero_point false", "AWQ's GEMM layout is asymmetric")
    bits = _bits("awq", quant.get("bits", quant.get("w_bit")), (4,))
    group = _group("awq", quant.get("group_size", quant.get("q_group_size")))
    scheme = Scheme("awq", bits, group, False)
    skip = tuple(quant.get("modules_to_not_convert") or ())
    return CheckpointQuant("awq", ((("Linear",), scheme),), skip)


def _compressed_tensors(quant: dict[str, Any]) -> CheckpointQuant:
    method = "compressed-tensors"
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(method, f"quantization_status {status!r}", "radixrt reads compressed ones")
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if quant.get(field):
            raise _refuse(method, field, "radixrt reads weight quantization only")
    schemes = []
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = group.get("format") or quant.get("format")
        scheme = _ct_scheme(f"config_groups.{name}", fmt, group)
        schemes.append((tuple(group.get("targets") or ()), scheme))
    if not schemes:
        raise _refuse(method, "config_groups", "none given")
    return CheckpointQuant(method, tuple(schemes), tuple(quant.get("ignore") or ()))


def _ct_scheme(where: str, fmt: Any, group: dict[str, Any]) -> Scheme:
    """One compressed-tensors config group's scheme: its weights, and activations only where
    our kernels quantize them the same way (dynamically, per token) or not at all."""
    method = "compressed-tensors"
    if fmt not in CT_FORMATS:
        raise _refuse(method, f"{where} format {fmt!r}", f"supported: {', '.join(CT_FORMATS)}")
    if group.get("output_activations"):
        raise _refuse(method, f"{where} output_activations", "outputs stay float")
    acts = group.get("input_activations")
    if acts and not (acts.get("dynamic") is True and acts.get("strategy") in ("token", "group")):
        raise _refuse(
            method,
            f"{where} static input_activations",
            "activations are quantized per token, dynamically",
        )
    w = group.get("weights") or {}
    strategy, symmetric = w.get("strategy"), bool(w.get("symmetric", True))
    if fmt == "pack-quantized":
        if w.get("type", "int") != "int" or strategy not in ("group", "channel"):
            raise _refuse(
                method, f"{where} weights {w.get('type')} {strategy}", "int, by group or channel"
            )
        bits = _bits(method, w.get("num_bits"), (4, 8))
        group_size = _group(method, w.get("group_size")) if strategy == "group" else 0
        return Scheme("pack", bits, group_size, symmetric)
    kind = "int" if fmt == "int-quantized" else "float"
    if w.get("type") != kind or w.get("num_bits") != 8 or strategy not in ("channel", "tensor"):
        why = f"{kind}8 weights, one scale per channel or tensor"
        raise _refuse(method, f"{where} weights {w.get('type')}{w.get('num_bits')} {strategy}", why)
    if not symmetric:
        raise _refuse(method, f"{where} asymmetric {fmt} weights", "symmetric only")
    return Scheme("int8" if kind == "int" else "fp8", 8, 0, True)


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' and GPTQ/AWQ's target names: a class name (every linear here is
    `Linear`), `re:` and a regex, or a module name (or its last parts)."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


# ---- the tensors -------------------------------------------------------------------------
def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each (value j in bits bits*j) -> uint8
    [R, C*32/bits]. 8 bits: the words' bytes as stored (little-endian). 4 bits: each word's
    8 nibbles spread to the 8 bytes of an int64 (byte j = nibble j), with shifts and masks on
    whole words rather than on every byte."""
    rows = words.shape[0]
    if bits == 8:
        return words.contiguous().view(torch.uint8).view(rows, -1)
    x = words.to(torch.int64) & 0xFFFFFFFF
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0F
    return x.view(torch.uint8).view(rows, -1)


def _group_ints(
    source: WeightSource, names: set[str], module: str, scheme: Scheme, desc_act: bool
) -> GroupInts:
    """One linear's integers, scales, zero points and groups, as its layout stores them."""
    bits, offset = scheme.bits, 1 << (scheme.bits - 1)
    g_idx: torch.Tensor | None = None
    if scheme.layout in GPTQ_FORMATS:
        q = _unpack(source.whole(f"{module}.qweight").t().contiguous(), bits)  # [N, K]
        scale = source.whole(f"{module}.scales").t().float()
        zero = _unpack(source.whole(f"{module}.qzeros"), bits)[:, : scale.shape[0]].t().float()
        if scheme.layout == "gptq":
            zero += 1  # the v1 format stores z - 1
        g_idx = _optional(source, names, f"{module}.g_idx")
        if desc_act and g_idx is None:
            raise ValueError(f"GPTQ desc_act: {module} has no g_idx")
    elif scheme.layout == "awq":
        order = torch.tensor(AWQ_ORDER).argsort()
        qw = _unpack(source.whole(f"{module}.qweight"), bits)  # [K, N] in AWQ's order
        q = qw.view(qw.shape[0], -1, 8)[..., order].reshape(qw.shape[0], -1).t().contiguous()
        scale = source.whole(f"{module}.scales").t().float()
        qz = _unpack(source.whole(f"{module}.qzeros"), bits)
        zero = qz.view(qz.shape[0], -1, 8)[..., order].reshape(qz.shape[0], -1).t().float()
    else:  # compressed-tensors pack-quantized
        n, k = (int(v) for v in source.whole(f"{module}.weight_shape"))
        q = _unpack(source.whole(f"{module}.weight_packed"), bits)[:, :k]
        scale = source.whole(f"{module}.weight_scale").float().reshape(n, -1)
        if scheme.symmetric:
            zero = torch.full_like(scale, offset)
        else:
            packed = source.whole(f"{module}.weight_zero_point").reshape(-1, scale.shape[1])
            zero = _unpack(packed.t().contiguous(), bits)[:, :n].t().float()
        g_idx = _optional(source, names, f"{module}.weight_g_idx")
    k = q.shape[1]
    if g_idx is not None:
        groups = g_idx.long()
    elif scheme.group:
        groups = torch.arange(k) // scheme.group
    else:
        groups = torch.zeros(k, dtype=torch.long)
    if groups.shape != (k,) or scale.shape != zero.shape or scale.shape[0] != q.shape[0]:
        raise ValueError(f"{module}: its quantized tensors' shapes do not agree")
    return GroupInts(q, scale, zero, groups)


def _optional(source: WeightSource, names: set[str], name: str) -> torch.Tensor | None:
    return source.whole(name) if name in names else None


def _channel_ints(
    source: WeightSource, module: str, scheme: Scheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and float32 scales [N] of a per-channel (or per-tensor) 8-bit linear: int8
    as stored; FP8 requantized to int8, a few rows at a time."""
    weight = source.whole(f"{module}.weight")
    n = weight.shape[0]
    scale = source.whole(f"{module}.weight_scale").float().reshape(-1).expand(n).contiguous()
    if scheme.layout == "int8":
        if weight.dtype != torch.int8:
            raise ValueError(f"{module}.weight is {weight.dtype}, not int8")
        return weight, scale
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight is {weight.dtype}, not float8_e4m3fn")
    q = torch.empty(weight.shape, dtype=torch.int8)
    out = torch.empty(n)
    step = max(1, FP8_ROWS_BYTES // (4 * max(weight.shape[1], 1)))
    for at in range(0, n, step):
        rows = weight[at : at + step].float()
        top = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        q[at : at + step] = (
            torch.round(rows * (127 / top)[:, None]).clamp_(-127, 127).to(torch.int8)
        )
        out[at : at + step] = scale[at : at + step] * top / 127
    return q, out


def _stack(parts: list[GroupInts], modules: list[str]) -> GroupInts:
    """Several linears' rows as one: they must take their inputs in the same groups."""
    first = parts[0]
    for part, module in zip(parts[1:], modules[1:]):
        if not torch.equal(part.groups, first.groups):
            raise ValueError(
                f"act-order: {module} groups its inputs unlike {modules[0]}, and radixrt fuses them"
            )
    return GroupInts(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        first.groups,
    )


def _to_groups(ints: GroupInts, bits: int) -> PackedGroups | PermutedGroups:
    """Grouped integers as the kernel's groups of 32: inputs sorted by group (where act-order
    scattered them), then each 32 of them one group of ours, which must lie in one of theirs."""
    n, k = ints.q.shape
    perm = torch.argsort(ints.groups, stable=True)
    ordered = not bool((perm != torch.arange(k)).any())
    q, groups = (ints.q, ints.groups) if ordered else (ints.q[:, perm], ints.groups[perm])
    blocks = -(-k // GROUP)
    padded_groups = torch.cat([groups, groups[-1:].expand(blocks * GROUP - k)])
    per_block = padded_groups.view(blocks, GROUP)
    if (per_block != per_block[:, :1]).any():
        raise ValueError(f"quantization groups that do not fall in blocks of {GROUP} inputs")
    if int(groups.max()) >= ints.scale.shape[1]:
        raise ValueError("g_idx names a group beyond the scales")
    block_group = per_block[:, 0]
    d = ints.scale[:, block_group].half()
    zero = ints.zero[:, block_group]
    if k % GROUP:
        values = torch.zeros(n, blocks * GROUP, dtype=torch.uint8)
        values[:, :k] = q
    else:
        values = q.contiguous()
    values = values.view(n, blocks, GROUP)
    if bits == 4:
        # GGUF's pairing, byte b = value b | value b + 16 << 4: on int64 words of 8 values
        # (a value is at most 15, so shifted left by 4 it stays within its byte)
        words = values.view(torch.int64)  # [N, blocks, 4]: values 0-7, 8-15, 16-23, 24-31
        packed_q = (words[..., :2] | (words[..., 2:] << 4)).view(torch.uint8)
        m = (-(d.float() * zero)).half()
        width = Bits.INT4
    else:
        packed_q = (values.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        m = (d.float() * (128 - zero)).half()
        width = Bits.INT8
    symmetric = bool((zero == (8 if bits == 4 else 128)).all())  # its offsets are implied
    weight = PackedGroups.from_blocks(packed_q, d, None if symmetric else m, k, width)
    return weight if ordered else PermutedGroups(weight, perm)
