"""LoRA adapters over the served model: reading peft's files into this rank's slices, a bounded
pool of device slots (least recently used evicted), and the call sites that add each row's
adapter delta to the base projection's output.

An adapter adapts q, k, v, o, gate, up and down (any subset, ranks free up to
`--max-lora-rank`). The model fuses q/k/v and gate/up, so the deltas are added per call site:
`qkv`, `o`, `gate_up` and `down`. A site's weights stack its projections: A [in, n * r_max]
(each projection's rank block side by side, zero past the adapter's own rank), B
[n * r_max, out] block diagonal, with peft's scaling (alpha / r, or alpha / sqrt(r) under
rsLoRA) folded into B. Under `--tp-size` a column-parallel base (q, k, v, gate, up) keeps A
whole and its rows of B; a row-parallel one (o, down) its columns of A and B whole: the ranks'
partial deltas join the base's partial outputs in the one all-reduce that follows.

The pool holds `--max-loras-per-batch` slots; every site keeps all slots' blocks slot-major
([S, in, R], [S, R, out]), so a batch over slots 0..n-1 multiplies by views of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from radixrt.kernels.lora import Segments, batched

if TYPE_CHECKING:
    from radixrt.models.interface import CausalLM, Projection

# the peft projections an adapter may hold; the model's `projections` say which it fuses where
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_(A|B)\.weight"
)


class AdapterError(ValueError):
    """An adapter that cannot be served over this model; the message is one line naming why."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read for this rank: per (layer, site) its A [in, R] and B [R, out] blocks
    (R = projections x `max_rank`), on the CPU in the pool's dtype; `digest` names its
    weights (the cache namespace changes when they do), `rank` its largest rank."""

    name: str
    path: str
    rank: int
    digest: str
    blocks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    name: str, path: str | Path, model: CausalLM, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """peft's `adapter_config.json` and `adapter_model.safetensors` in folder `path`, sliced for
    this rank of `model`; AdapterError (one line) for what cannot be served: a missing file, a
    module other than q/k/v/o/gate/up/down, DoRA, biases, a rank above `max_rank`, a shape or a
    layer the base model does not have, or the experts of a mixture-of-experts layer."""
    folder = Path(path)
    config_file, weights_file = (
        folder / "adapter_config.json",
        folder / "adapter_model.safetensors",
    )
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(
            f"adapter {name!r}: {folder} needs adapter_config.json and adapter_model.safetensors"
        )
    config = json.loads(config_file.read_text())
    _check_config(name, config)
    tensors = _read_tensors(name, weights_file)
    rank = max(a.shape[0] for a, _ in tensors.values())
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r} has rank {rank}; this server takes at most {max_rank}"
        )
    blocks = {}
    sites = model.projections()
    for (layer, site), projection in sites.items():
        parts = {p: tensors.pop((layer, p)) for p in projection.parts if (layer, p) in tensors}
        if parts:
            blocks[layer, site] = _site_block(name, config, parts, projection, max_rank, dtype)
    layers = 1 + max((layer for layer, _ in sites), default=-1)
    for layer, part in sorted(tensors):  # none of the model's projections took it
        where = (
            f"layer {layer}; the model has {layers}"
            if layer >= layers
            else f"{part}_proj of layer {layer}, which takes none (the experts of a MoE layer)"
        )
        raise AdapterError(f"adapter {name!r} adapts {where}")
    return LoraAdapter(name, str(folder), rank, _digest(weights_file, config_file), blocks)


def _check_config(name: str, config: dict[str, Any]) -> None:
    for key, bad, why in (
        ("use_dora", True, "DoRA"),
        ("fan_in_fan_out", True, "fan_in_fan_out weights"),
    ):
        if config.get(key) == bad:
            raise AdapterError(f"adapter {name!r} uses {why}, which radixrt does not serve")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter {name!r} trains biases (bias={config['bias']!r}); radixrt serves none"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            f"adapter {name!r} saves whole modules {config['modules_to_save']}; radixrt serves LoRA weights only"
        )
    if config.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r} sets alpha_pattern; radixrt takes one lora_alpha")


def _read_tensors(
    name: str, file: Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A [r, in], B [out, r]) as stored; AdapterError for a tensor of
    another module or a projection missing one of its pair."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            match = _KEY.fullmatch(key)
            if match is None:
                raise AdapterError(
                    f"adapter {name!r}: {key} adapts a module radixrt does not ({', '.join(TARGETS)} only)"
                )
            layer, projection, ab = match.groups()
            found[int(layer), projection, ab] = f.get_tensor(key).float()
    pairs = {}
    for layer, projection, ab in found:
        if ab == "A":
            b = found.get((layer, projection, "B"))
            if b is None:
                raise AdapterError(
                    f"adapter {name!r}: layer {layer} {projection} has lora_A but no lora_B"
                )
            pairs[layer, projection] = (found[layer, projection, "A"], b)
    if not pairs:
        raise AdapterError(f"adapter {name!r} holds no LoRA weights")
    return pairs


def _site_block(
    name: str,
    config: dict[str, Any],
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
    site: Projection,
    max_rank: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One site's A [in, n * max_rank] and B [n * max_rank, out] for this rank (zeros for a
    projection the adapter leaves alone)."""
    a_block = torch.zeros(site.width, len(site.parts) * max_rank)
    b_block = torch.zeros(len(site.parts) * max_rank, site.out)
    col = 0
    for j, (projection, (start, end), expect_out) in enumerate(
        zip(site.parts, site.rows, site.full_out)
    ):
        width = end - start
        if projection in parts:
            a, b = parts[projection]
            r = a.shape[0]
            expect_in = site.full_in
            if a.shape[1] != expect_in or b.shape != (expect_out, r):
                raise AdapterError(
                    f"adapter {name!r}: {projection}_proj A {tuple(a.shape)}, B {tuple(b.shape)} "
                    f"do not fit the base layer ({expect_out} x {expect_in})"
                )
            a = a if site.cols is None else a[:, site.cols[0] : site.cols[1]]
            block = slice(j * max_rank, j * max_rank + r)
            a_block[:, block] = a.T
            b_block[block, col : col + width] = b[start:end].T * _scaling(config, r)
        col += width
    return a_block.to(dtype), b_block.to(dtype)


def _scaling(config: dict[str, Any], rank: int) -> float:
    """peft's: lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA."""
    alpha: float = config.get("lora_alpha", rank)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _digest(*files: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class LoraBatch:
    """One forward's rows as adapters see them: their segments by pool slot."""

    segments: Segments

    def add_delta(
        self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """`y` plus each row's adapter delta, in place; `a` [S, in, R] and `b` [S, R, out] hold
        every pool slot's blocks."""
        if x.is_cuda:
            from radixrt.kernels.lora_sgmv import lora_sgmv_fwd

            out: torch.Tensor = lora_sgmv_fwd(y, x.contiguous(), a, b, self.segments)
        else:
            out = batched(y, x, a, b, self.segments)
        return out


class LoraState:
    """What every adapted site of one model reads: the batch now running (None: the base model
    alone, as in CUDA-graph capture)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraSite(nn.Module):
    """A base projection (any module: `nn.Linear`, prepacked, int8) plus each row's adapter
    delta; `a` [S, in, R] and `b` [S, R, out] hold the blocks of all S pool slots."""

    a: torch.Tensor  # buffers
    b: torch.Tensor

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, state: LoraState):
        super().__init__()
        self.base = base
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        return batch.add_delta(y, x, self.a, self.b)
