"""A GGUF file's Q4_0, Q4_1 and Q8_0 linears read straight into the grouped kernel's packed
layout (`kernels/int4_gemm.py`): their blocks are copied, never dequantized, so serving them
holds no float32 copy of those weights (`--quantization gguf`, and `int4` on a GGUF model).

GGUF stores a linear [N, K] as N rows of K/32 blocks: Q4_0 is a float16 scale d and 16 bytes of
nibbles (w = d (q - 8)), Q4_1 a scale d, an offset m and the nibbles (w = d q + m), Q8_0 a scale
and 32 signed bytes. llama.cpp's converter reorders the rows of a Llama's q and k projections
(the two halves of each head's rotary pairs interleaved); `_unpermute` puts them back, as
transformers does when it dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixrt.executor.model_loader import read_into
from radixrt.kernels.int4_gemm import Bits, PackedGroups

# GGUF type name -> (bits, bytes before the values: d, or d and m)
PACKED_TYPES = {"Q4_0": (Bits.INT4, 2), "Q4_1": (Bits.INT4, 4), "Q8_0": (Bits.INT8, 2)}
ARCHITECTURES = ("llama", "qwen2")  # whose tensor names and row orders `plan` knows


@dataclass(frozen=True)
class Part:
    """One GGUF tensor that fills rows of a linear, and the heads whose rows the converter
    permuted (0: none)."""

    name: str
    heads: int = 0


@dataclass(frozen=True)
class GGUFPlan:
    """The linears (module name -> parts, stacked by rows) whose every part is a packed type
    of one width, in the file `reader` reads (gguf's `GGUFReader`: opened once, since parsing
    the header of a model with a large vocabulary takes seconds)."""

    reader: Any
    linears: dict[str, list[Part]]

    def meta_weights(self, tied: bool) -> frozenset[str]:
        """Parameters never to fill as float: the packed linears' weights (a tied lm_head's is
        the embedding, which stays float)."""
        return frozenset(f"{m}.weight" for m in self.linears if not (tied and m == "lm_head"))


def gguf_source(model_folder: Path, marker: str) -> Path | None:
    """The GGUF file a converted model folder came from (`convert_gguf` writes its path in the
    marker file), or None for a model that was never GGUF or whose file is gone (conversions
    are shared by content: the marker may name another virtualenv's copy)."""
    path = model_folder / marker
    source = Path(path.read_text()) if path.is_file() else None
    return source if source is not None and source.is_file() else None


def plan(path: Path, config) -> GGUFPlan:
    """Which linears of a Llama-shaped model (fused q/k/v and gate/up, as `models/llama.py`
    builds them) `path` holds in packed types; none for an architecture it cannot map."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"packed GGUF weights need a {' or '.join(ARCHITECTURES)} GGUF, not {arch}"
        )
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    rope = arch == "llama"  # the converter permutes q and k rows of Llama only
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    wanted: dict[str, list[Part]] = {}
    for i in range(config.num_hidden_layers):
        b, me = f"blk.{i}.", f"layers.{i}."
        wanted[me + "self_attn.qkv_proj"] = [
            Part(b + "attn_q.weight", heads if rope else 0),
            Part(b + "attn_k.weight", kv_heads if rope else 0),
            Part(b + "attn_v.weight"),
        ]
        wanted[me + "self_attn.o_proj"] = [Part(b + "attn_output.weight")]
        wanted[me + "mlp.gate_up_proj"] = [Part(b + "ffn_gate.weight"), Part(b + "ffn_up.weight")]
        wanted[me + "mlp.down_proj"] = [Part(b + "ffn_down.weight")]
    wanted["lm_head"] = [Part("output.weight" if "output.weight" in types else "token_embd.weight")]
    linears = {
        m: parts for m, parts in wanted.items() if _packable([types.get(p.name) for p in parts])
    }
    return GGUFPlan(reader, linears)


def read_linears(plan: GGUFPlan) -> dict[str, PackedGroups]:
    """Every planned linear, packed from the file's blocks."""
    tensors = {t.name: t for t in plan.reader.tensors}
    return {
        module: _stack([tensors[p.name] for p in parts], parts)
        for module, parts in plan.linears.items()
    }


def blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Bits]:
    """A Q4_0/Q4_1/Q8_0 GGUF tensor's rows of blocks: values [N, G, group bytes], d and m
    float16 [N, G] (m None for Q8_0), and their width."""
    bits, head = PACKED_TYPES[tensor.tensor_type.name]
    raw = torch.empty(int(tensor.n_bytes), dtype=torch.uint8)
    # read, not copied from the reader's map: pages read through it stay resident while the
    # reader lives, the whole file's by the last tensor
    with open(tensor.data.filename, "rb", buffering=0) as f:
        read_into(f.fileno(), raw, int(tensor.data_offset), f.name)
    n, k = int(tensor.shape[1]), int(tensor.shape[0])
    raw = raw.view(n, k // 32, head + bits.group_bytes)
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0]
    q = raw[..., head:]
    if tensor.tensor_type.name == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
    elif tensor.tensor_type.name == "Q4_0":
        m = (-8 * d.float()).half()  # exact: a power-of-two multiple
    else:
        m = None
    return q, d, m, bits


def _stack(tensors: list, parts: list[Part]) -> PackedGroups:
    """Several tensors' rows, one after the other, as one packed weight."""
    qs, ds, ms = [], [], []
    for tensor, part in zip(tensors, parts):
        q, d, m, bits = blocks(tensor)
        order = _unpermute(q.shape[0], part.heads)
        qs.append(q[order])
        ds.append(d[order])
        ms.append(None if m is None else m[order])
    m_all = None if ms[0] is None else torch.cat(ms)  # type: ignore[arg-type]
    return PackedGroups.from_blocks(
        torch.cat(qs), torch.cat(ds), m_all, int(tensors[0].shape[0]), bits
    )


def _packable(kinds: list[str | None]) -> bool:
    """Whether tensors of these GGUF types stack into one packed weight: all packed, one width."""
    if not all(k in PACKED_TYPES for k in kinds):
        return False
    return len({PACKED_TYPES[k][0] for k in kinds if k is not None}) == 1


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation over `heads` heads (0: the identity):
    its row (head, i, half) is Hugging Face's (head, half, i)."""
    index = torch.arange(rows)
    if heads == 0:
        return index
    return index.view(heads, -1, 2).transpose(1, 2).reshape(-1)


def _field(reader, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()
