"""What `--quantization` resolves to for one run, and why (`model_info` and the start-up log say
both).

`auto`, the default, serves a model given as a GGUF file (`--model default` or a `.gguf` path)
the way it is stored: its quantized linears packed (`gguf`), and on a CPU its F16/BF16 ones at 2
bytes a weight, never dequantized to float first, wherever that path runs (one rank, the CPU's
kernels or a CUDA GPU, no fixed-order mode). Every other model, and a GGUF where packing cannot
run, is served as its checkpoint says: float, or the checkpoint's own `quantization_config`. A
converted model folder is a float checkpoint: given by its path, it stays float. `none` (and
None, the Python API's spelling) always serves float linears; `int8`, `int4` and `gguf` are
taken as asked, or refused where they cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixrt.executor import gguf_weights
from radixrt.kernels.cpu_isa import Isa
from radixrt.kernels.int4_gemm import HALF_DTYPES, SUB_SCALED
from radixrt.models.linear import check_quantization

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHOICES = ("auto", "none", "int8", "int4", "gguf")


@dataclass(frozen=True)
class QuantChoice:
    """The linears' quantization this run serves (`name`; None: float), why (`reason`, one
    line), and the GGUF linears to read packed (`plan`: under `gguf`, and `int4` on a GGUF)."""

    name: str | None
    reason: str
    plan: gguf_weights.GGUFPlan | None = None


@dataclass(frozen=True)
class Ground:
    """What the choice depends on: the `--model` argument as given, the GGUF file the model
    folder was converted from (None: never GGUF), and where and how the run computes."""

    model_arg: str
    source: Path | None
    compute_device: torch.device
    isa: Isa | None
    tp_size: int
    deterministic: bool
    prequantized: bool  # the checkpoint has its own quantization_config


def choose(requested: str | None, ground: Ground, config: PretrainedConfig) -> QuantChoice:
    """Resolve `requested` (one of `CHOICES`, or None) on `ground`; ValueError, one line, where
    an explicit `gguf` has no GGUF file or packed linears to serve."""
    if requested == "auto":
        return _auto(ground, config)
    if requested in (None, "none"):
        return QuantChoice(None, "--quantization none: float linears")
    plan = _plan(requested, ground, config)
    stored = f" ({_stored(plan, ground)})" if plan is not None and plan.linears else ""
    return QuantChoice(requested, f"--quantization {requested}{stored}", plan)


def _plan(name: str, ground: Ground, config: PretrainedConfig) -> gguf_weights.GGUFPlan | None:
    """The linears to take packed from the GGUF file the model came from: under `gguf` (which
    needs one), and under `int4` where there is one (else int4 quantizes the float weights). The
    16-bit ones under `gguf` on a CPU only: `int4` quantizes them, and on a GPU, whose Triton
    kernel reads quantized groups only, float linears are 16-bit in the run's dtype already. One
    rank only: the packed rows are not cut into shards."""
    source = ground.source
    if name == "gguf" and (source is None or ground.tp_size > 1):
        raise ValueError("--quantization gguf needs a GGUF model (default, a .gguf path), tp 1")
    if name not in ("int4", "gguf") or source is None or ground.tp_size > 1:
        return None
    halves = name == "gguf" and ground.compute_device.type == "cpu"
    packed = gguf_weights.plan(source, config, halves)
    if name == "gguf" and not packed.linears:
        kinds = "/".join(
            kind
            for kind, bits in gguf_weights.PACKED_TYPES.items()
            if halves or bits not in HALF_DTYPES
        )
        families = "/".join(gguf_weights.ARCHITECTURES)
        raise ValueError(f"{source} has no {kinds} linears of a {families} model")
    return packed


def _stored(plan: gguf_weights.GGUFPlan, ground: Ground) -> str:
    """The GGUF types its planned linears are held in, for the reason: the quantized ones
    packed (Q3_K and Q2_K named with their widths: their own 3- and 2-bit groups on a CPU,
    8-bit ones on a GPU, `PackedGroups.to`), the 16-bit ones at 16 bits a weight."""
    kinds = {plan.tensors[p.name].kind.name for parts in plan.linears.values() for p in parts}
    halves = sorted(k for k in kinds if gguf_weights.PACKED_TYPES[k] in HALF_DTYPES)
    packed = sorted(kinds.difference(halves))
    held = [f"{'/'.join(packed)} packed"] if packed else []
    on_cpu = ground.compute_device.type == "cpu"
    widths = {k: int(w) if on_cpu else 8 for k, w in gguf_weights.PACKED_TYPES.items()}
    own = [
        f"{k} in {widths[k]}-bit groups"
        for k in packed
        if gguf_weights.PACKED_TYPES[k] in SUB_SCALED
    ]
    if own:
        held[0] += f", {', '.join(own)}"
    if halves:
        held.append(f"{'/'.join(halves)} at 16 bits a weight")
    return "; ".join(held)


def _auto(ground: Ground, config: PretrainedConfig) -> QuantChoice:
    """`gguf` for a model given as a GGUF file whose packed linears can run here; else float
    (or the checkpoint's own quantization), with the reason packing was not taken."""
    why_not = _why_not_packed(ground)
    if why_not is None:
        try:
            plan = _plan("gguf", ground, config)
        except ValueError as e:
            why_not = str(e)
        else:
            assert plan is not None  # `gguf` plans, or refuses
            reason = f"auto: the GGUF file's linears, as stored ({_stored(plan, ground)})"
            return QuantChoice("gguf", reason, plan)
    if ground.prequantized:
        return QuantChoice(None, "auto: the checkpoint's own quantization")
    return QuantChoice(None, f"auto: float linears ({why_not})")


def _why_not_packed(ground: Ground) -> str | None:
    """Why a run cannot serve its GGUF packed (None: it can)."""
    named_gguf = ground.model_arg == "default" or ground.model_arg.endswith(".gguf")
    if not named_gguf or ground.source is None:
        return "a float checkpoint"
    if ground.tp_size > 1:
        return "packed GGUF rows are not sharded over tensor-parallel ranks"
    if ground.deterministic:
        return "--enable-deterministic-inference has no fixed-order path for GGUF blocks"
    try:
        check_quantization("gguf", ground.compute_device, ground.isa)
    except ValueError as e:
        return str(e)
    return None
