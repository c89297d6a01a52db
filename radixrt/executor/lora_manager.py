"""This rank's LoRA adapters: the ones loaded (read once into host memory, by name), the device
pool's slots (`--max-loras-per-batch` of them, least recently used evicted), and each forward's
rows mapped to slots.

Every tensor-parallel rank keeps its own manager over its own slices; rank 0 sends loads and
unloads to the others (`tp_worker`), and each forward names each request's adapter, so the
ranks never need to agree on slots. The scheduler never lets one batch name more adapters than
there are slots (`engine/planner.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixrt.forward_batch import ForwardBatch
from radixrt.kernels.lora import Segments
from radixrt.models.lora import (
    AdapterError,
    LoraAdapter,
    LoraBatch,
    LoraSite,
    LoraState,
    read_adapter,
)

if TYPE_CHECKING:
    from radixrt.models.interface import CausalLM

__all__ = ["AdapterError", "AdapterInfo", "LoraManager", "default_max_rank", "parse_lora_paths"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 16  # without --max-lora-rank and without adapters at start


@dataclass(frozen=True)
class AdapterInfo:
    """What clients see of a loaded adapter (`list_lora_adapters`, /v1/models)."""

    name: str
    path: str
    rank: int
    digest: str


def parse_lora_paths(entries: tuple[str, ...]) -> dict[str, str]:
    """`--lora-paths name=path ...` (checked by `LoraSettings`) as {name: path}."""
    return dict(entry.split("=", 1) for entry in entries)


def default_max_rank(paths: dict[str, str]) -> int:
    """The largest rank the adapters given at start declare (peft's `r` and `rank_pattern`),
    or DEFAULT_MAX_RANK without any."""
    ranks = [DEFAULT_MAX_RANK] if not paths else []
    for path in paths.values():
        file = Path(path) / "adapter_config.json"
        if file.is_file():
            config = json.loads(file.read_text())
            ranks += [
                int(config.get("r", 0)),
                *map(int, (config.get("rank_pattern") or {}).values()),
            ]
    return max(ranks or [DEFAULT_MAX_RANK])


class LoraManager:
    """Adapters over `model` (its dense call sites wrapped by `LoraSite`s sharing one
    `LoraState`), a pool of `num_slots` slots of rank up to `max_rank`."""

    def __init__(self, model: CausalLM, num_slots: int, max_rank: int, dtype: torch.dtype):
        self.model = model
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.state = LoraState()
        self.sites = _attach(model, num_slots, max_rank, dtype, self.state)
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read the adapter at `path` as `name`; AdapterError (one line) if it cannot be served
        or the name is taken."""
        if not name or not isinstance(name, str):
            raise AdapterError("an adapter needs a non-empty name")
        if name in self.adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        start = time.monotonic()
        adapter = read_adapter(name, path, self.model, self.max_rank, self.dtype)
        self.adapters[name] = adapter
        logger.info(
            "loaded adapter %s (rank %d) from %s in %.2fs",
            name,
            adapter.rank,
            path,
            time.monotonic() - start,
        )
        return self.info(name)

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self.resident.pop(name, None)

    def info(self, name: str) -> AdapterInfo:
        a = self.adapters[name]
        return AdapterInfo(a.name, a.path, a.rank, a.digest)

    def prepare(self, batch: ForwardBatch) -> None:
        """Map the batch's rows to slots (loading adapters not resident) for the next forward."""
        names = batch.lora_names or []
        slots = self._place({n for n in names if n})
        row_slots = []
        for name, n in zip(names, batch.extend_lens):
            row_slots += [slots[name] if name else -1] * n
        device = batch.input_ids.device
        self.state.batch = LoraBatch(Segments.of(row_slots, device))

    def finish(self) -> None:
        self.state.batch = None

    def _place(self, names: set[str]) -> dict[str, int]:
        """A slot for each of `names` (at most `num_slots`): resident ones stay, the others take
        free slots, then those of the least recently used adapters not in `names`."""
        if len(names) > self.num_slots:
            raise RuntimeError(f"{len(names)} adapters in one batch; the pool has {self.num_slots}")
        for name in sorted(names):
            if name not in self.adapters:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in sorted(names - set(self.resident)):
            self.resident[name] = self._free_slot(names)
            self._write(self.resident[name], self.adapters[name])
        return {name: self.resident[name] for name in names}

    def _free_slot(self, keep: set[str]) -> int:
        taken = set(self.resident.values())
        free = [s for s in range(self.num_slots) if s not in taken]
        if free:
            return free[0]
        victim = next(n for n in self.resident if n not in keep)
        return self.resident.pop(victim)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s blocks into `slot` of every site (zeros where it adapts nothing)."""
        for key, site in self.sites.items():
            block = adapter.blocks.get(key)
            if block is None:
                site.a[slot].zero_()
                site.b[slot].zero_()
            else:
                site.a[slot].copy_(block[0])
                site.b[slot].copy_(block[1])


def _attach(
    model: CausalLM, num_slots: int, max_rank: int, dtype: torch.dtype, state: LoraState
) -> dict[tuple[int, str], LoraSite]:
    """Wrap each of the model's projections (`CausalLM.projections`) in a `LoraSite`."""
    device = next(model.parameters()).device
    sites = {}
    for (i, site), projection in model.projections().items():
        per_slot = len(projection.parts) * max_rank
        a = torch.zeros(num_slots, projection.width, per_slot, dtype=dtype, device=device)
        b = torch.zeros(num_slots, per_slot, projection.out, dtype=dtype, device=device)
        wrapped = LoraSite(projection.linear, a, b, state)
        setattr(projection.owner, projection.attr, wrapped)
        sites[i, site] = wrapped
    return sites
