"""Quantized KV rows (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`): one byte a value and one
float32 scale per token and KV head, stored together (int8: of the row rotated by a Hadamard
matrix).

A quantized pool buffer is `int8 [slots, kv_heads, head_dim + 4]`: each (token, head) row holds
its `head_dim` codes then the 4 bytes of its scale, so a slot's page carries its own scales and
every tier (the host pool, swap, the disk tier's blocks) moves the quantized form as plain bytes,
as is, with no code of its own. A row is quantized once, when the token's K/V is written: the
scale is the row's largest magnitude over the format's largest code (127 for int8, 448 for
E4M3, 57344 for E5M2), so every value is within half a step of its code; a row of zeros gets
scale 0 and codes 0. Reading multiplies codes by the scale (`dequantize`, the C decode kernel in
place, `kernels/cpu_paged`, or the Triton decode and extend kernels in place as they load a
tile, `kernels/extend_attention._load_rows`).

int8 rows are quantized rotated (`rotation`, applied by the pool's `set_kv`; both attention
backends rotate queries and outputs to match, `TokenToKVPool.attend`): a key's outlier
channels, spread over the whole row, no longer leave its other channels few levels. On the
default model greedy continuations equal float32 KV's on 30 of 40 prompts rotated against 19
unrotated (tests/engine/test_kv_cache_quality, docs/benchmarks.md).
"""

from __future__ import annotations

import enum

import torch

SCALE_BYTES = 4  # one float32 per row


class KVFormat(str, enum.Enum):
    """A quantized KV format, by its `--kv-cache-dtype` name (`auto`, the model's dtype, is
    no format: the pool holds floats)."""

    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype a row's codes are, viewed from its bytes."""
        return {
            KVFormat.INT8: torch.int8,
            KVFormat.FP8_E4M3: torch.float8_e4m3fn,
            KVFormat.FP8_E5M2: torch.float8_e5m2,
        }[self]

    @property
    def max_code(self) -> float:
        """The largest magnitude a code holds: a row's largest value maps onto it."""
        if self is KVFormat.INT8:
            return 127.0
        return float(torch.finfo(self.code_dtype).max)

    @property
    def kernel_kind(self) -> int:
        """How the kernels decode a code (`kernels/cpu_paged`, the Triton attention kernels: 0 int8,
        1 E4M3, 2 E5M2)."""
        return list(KVFormat).index(self)

    @property
    def rotated(self) -> bool:
        """Whether rows are stored rotated (`rotation`): int8's, whose one scale a row leaves
        the small channels few levels; not fp8's, whose codes keep each value's own exponent
        and lose to the rotation (greedy agreement on the default model 15 -> 6 of 40 for E4M3,
        tests/engine/test_kv_cache_quality's prompts)."""
        return self is KVFormat.INT8

    def row_width(self, head_dim: int) -> int:
        """Bytes of one (token, head) row: the codes, then the scale."""
        return head_dim + SCALE_BYTES

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Float rows `[..., D]` -> their quantized rows, `int8 [..., D + 4]`."""
        x = x.float()
        scale = x.abs().amax(dim=-1, keepdim=True) / self.max_code
        scaled = x / torch.where(scale > 0, scale, 1.0)
        if self is KVFormat.INT8:
            codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
        else:
            codes = scaled.clamp_(-self.max_code, self.max_code).to(self.code_dtype)
        return torch.cat([codes.view(torch.int8), scale.view(torch.int8)], dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Quantized rows `int8 [..., D + 4]` -> their values `[..., D]` in `dtype`."""
        d = rows.shape[-1] - SCALE_BYTES
        codes = rows[..., :d].view(self.code_dtype)
        scale = rows[..., d:].contiguous().view(torch.float32)
        return (codes.float() * scale).to(dtype)


def rotation(head_dim: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix `[D, D]` an int8 pool's K and V rows are multiplied by
    before they are quantized (as in QuaRot / QuIP#): each rotated value mixes all of a block's
    values, so the few outlier channels of a key or value no longer set the whole row's scale and
    leave the small channels a handful of levels. Symmetric and its own inverse, so attention
    reads rotated rows unchanged by rotating the query the same way (`q R . k R = q . k`) and its
    output back (`(sum p v R) R = sum p v`). Blocks of the largest power of two dividing D (all
    of a 64 or 128 head; the identity for an odd D); fixed, so pages stored under it stay valid."""
    block = head_dim & -head_dim
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    return torch.kron(torch.eye(head_dim // block), h / block**0.5)


def parse_kv_format(name: str) -> KVFormat | None:
    """`--kv-cache-dtype` -> its format; None for `auto` (the model's dtype)."""
    return None if name == "auto" else KVFormat(name)


def resolve_kv_format(name: str, device: torch.device, attention_backend: str) -> KVFormat | None:
    """`--kv-cache-dtype name` for a pool on `device` read by `attention_backend` (`auto`,
    `torch`, `triton`): its format, None for `auto`. Every format is read by the torch backend
    on the CPU (C in place, or gather and dequantize) and by the Triton kernels (`auto` on CUDA,
    or `triton` on either device: on the CPU under Triton's interpreter), which dequantize the
    rows as they load them; ValueError, one line, for the torch backend on CUDA, which reads
    the model's dtype only."""
    if name == "auto":
        return None
    fmt = KVFormat(name)
    backend = attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch" and device.type != "cpu":
        raise ValueError(
            f"--kv-cache-dtype {name}: the torch attention backend on {device.type} reads the KV"
            " pool at the model's dtype only; the triton backend (CUDA's default) honours it"
        )
    return fmt
