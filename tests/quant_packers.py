"""GPTQ and AWQ checkpoints written from a float model folder in their published layouts, by
round-to-nearest (what matters to a loader is the layout, not how the integers were chosen):

- GPTQ (AutoGPTQ's `QuantLinear.pack`, `checkpoint_format` gptq): `qweight` int32 [K/8, N],
  input 8i + j in bits 4j of word i (down a column); `qzeros` int32 [G, N/8], output 8c + j in
  bits 4j of word c, stored as z - 1 (the v1 format); `scales` float16 [G, N]; `g_idx` int32
  [K]. Act-order (`desc_act`): inputs are quantized in an order `perm` (GPTQ's: by the
  Hessian's diagonal, the same for every linear fed the same inputs: here seeded, one per
  input), group i // g holds the i-th input of that order, so g_idx[perm[i]] = i // g; the last
  group may be short (AutoGPTQ takes ceil(K / g) groups). Symmetric: z = 8, scale = 2 max|w| / 15.
- AWQ (AutoAWQ's `WQLinear_GEMM`, version gemm): `qweight` int32 [K, N/8] and `qzeros` int32
  [G, N/8], outputs packed along a row, output 8c + AWQ_ORDER[i] in bits 4i of word c;
  `scales` float16 [G, N]; always asymmetric, groups contiguous.

Each writer also returns the float weights its integers stand for, dequantized, which
`write_dequantized` saves as the float reference transformers loads (transformers reads
neither format on a CPU without GPTQModel/AutoAWQ)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers import (
    QUALITY_POSITIONS,
    QUALITY_TEXT,
    QualityReference,
    quality_gates,
    teacher_forced_logits,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Rounded:
    """A weight [N, K] by group: q [N, K] in 0..15, scale float16 and zero [G, N], g_idx [K]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        s = self.scale.float()[self.g_idx].t()  # [N, K]
        z = self.zero.float()[self.g_idx].t()
        return (s * (self.q.float() - z)).contiguous()


def round_groups(w: torch.Tensor, g_idx: torch.Tensor, symmetric: bool) -> Rounded:
    """4-bit round-to-nearest of w [N, K] in the groups g_idx names (AutoGPTQ's quantizer)."""
    n, _ = w.shape
    groups = int(g_idx.max()) + 1
    scale = torch.empty(groups, n, dtype=torch.float16)
    zero = torch.empty(groups, n)
    q = torch.empty(w.shape, dtype=torch.uint8)
    for g in range(groups):
        cols = (g_idx == g).nonzero().squeeze(1)
        part = w[:, cols].float()
        if symmetric:
            top = part.abs().amax(1).clamp_min(1e-8)
            s, z = (2 * top / 15).half(), torch.full((n,), 8.0)
        else:
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            s = ((high - low) / 15).clamp_min(1e-8).half()
            z = torch.round(-low / s.float()).clamp(0, 15)
        scale[g], zero[g] = s, z
        q[:, cols] = (
            torch.round(part / s.float()[:, None] + z[:, None]).clamp(0, 15).to(torch.uint8)
        )
    return Rounded(q, scale, zero, g_idx)


def pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint [R, 8C] 4-bit values -> int32 [R, C]: value 8c + order[i] in bits 4i of word c."""
    rows = values.shape[0]
    v = values.to(torch.int64).view(rows, -1, 8)[..., list(order)]
    words = (v << torch.arange(0, 32, 4)).sum(-1)
    return (words & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)


def gptq_tensors(prefix: str, r: Rounded) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.qweight": pack_words(r.q).t().contiguous(),  # [N, K/8] -> [K/8, N]
        f"{prefix}.qzeros": pack_words((r.zero - 1).to(torch.int64)),
        f"{prefix}.scales": r.scale,
        f"{prefix}.g_idx": r.g_idx.to(torch.int32),
    }


def awq_tensors(prefix: str, r: Rounded) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.qweight": pack_words(r.q.t().contiguous(), AWQ_ORDER),
        f"{prefix}.qzeros": pack_words(r.zero.to(torch.int64), AWQ_ORDER),
        f"{prefix}.scales": r.scale,
    }


def write_quantized(
    src: Path, out: Path, method: str, group: int, symmetric: bool = False, desc_act: bool = False
) -> dict[str, torch.Tensor]:
    """`src`'s float checkpoint as a GPTQ or AWQ one in `out` (config, tokenizer copied);
    returns the dequantized float weights of every quantized linear, by tensor name."""
    weights = load_file(src / "model.safetensors")
    perms: dict[str, torch.Tensor] = {}  # one act-order per input: q/k/v and gate/up share it
    state, dequantized = {}, {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LINEARS:
            state[name] = w
            continue
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        if desc_act:
            seed = torch.Generator().manual_seed(len(perms))
            perm = perms.setdefault(_input_of(module), torch.randperm(k, generator=seed))
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // group
        rounded = round_groups(w, g_idx, symmetric)
        state.update(
            gptq_tensors(module, rounded) if method == "gptq" else awq_tensors(module, rounded)
        )
        dequantized[name] = rounded.dequantize()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if method == "gptq":
        quant = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": desc_act,
            "sym": symmetric,
            "checkpoint_format": "gptq",
        }
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
        quant["zero_point"] = True
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))
    copy_tokenizer(src, out)
    return dequantized


def _input_of(module: str) -> str:
    """Which input a linear takes: q/k/v share their layer's, gate/up theirs."""
    parent, _, kind = module.rpartition(".")
    return f"{parent}.{ {'q_proj': 'qkv', 'k_proj': 'qkv', 'v_proj': 'qkv', 'up_proj': 'gate_up', 'gate_proj': 'gate_up'}.get(kind, kind) }"


def write_dequantized(src: Path, out: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """`src`'s float checkpoint with the linears replaced by their dequantized weights."""
    weights = {**load_file(src / "model.safetensors"), **dequantized}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    copy_tokenizer(src, out)


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


# ---- what tests/executor/test_prequantized*.py share --------------------------------------
LAYERS = 2  # of the default model's 30: a trained model small enough to quantize in seconds
POSITIONS = QUALITY_POSITIONS  # of the quality text, teacher-forced (the gates' own)
# float16 scales and offsets, float32 sums in another order: logits of about 20 differ by
EXACT = 0.05


def write_small_model(default_model_dir: Path, folder: Path) -> Path:
    """The default model's first `LAYERS` layers, as a float checkpoint in `folder`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, num_hidden_layers=LAYERS
    )
    model.save_pretrained(folder)
    copy_tokenizer(default_model_dir, folder)
    return folder


def quality_ids(folder: Path) -> list[int]:
    """The quality text's first ids, as many as the gates score (and one more)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.encode(QUALITY_TEXT.read_text())[: POSITIONS + 1]


def transformers_logits(folder, ids: list[int], compressed: bool = False) -> torch.Tensor:
    """transformers' logits [n, V] float64 of `folder` (compressed-tensors decompressed)."""
    from transformers import AutoModelForCausalLM

    extra = {}
    if compressed:
        from transformers import CompressedTensorsConfig

        extra["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double()


def runner(folder, **overrides):
    """A ModelRunner of `folder` (the torch attention backend, a small pool)."""
    from radixrt.config import ServerArgs
    from radixrt.executor.model_runner import ModelRunner

    args = {"model": str(folder), "max_total_tokens": 1024, "attention_backend": "torch"}
    return ModelRunner(ServerArgs(**{**args, **overrides}).executor)


def held_to_transformers(folder, ids, reference: torch.Tensor, name: str, exact_atol: float):
    """Our logits against transformers': through the C kernels within int4's gates
    (perplexity within 5%, top-1 >= 90%), and with the packed weights dequantized at each call
    (`--cpu-isa torch`'s path, switched on the same modules) within `exact_atol`."""
    from radixrt.kernels.cpu_isa import Isa
    from radixrt.models.linear import GroupedLinear, Int8Linear

    packed = runner(folder)
    gates = QualityReference(None, ids, reference[:POSITIONS])
    ratio, agreement = quality_gates(gates, packed, name)
    assert abs(ratio - 1) <= 0.05
    assert agreement >= 0.90
    linears = [m for m in packed.model.modules() if isinstance(m, GroupedLinear | Int8Linear)]
    for m in linears:
        m.isa = Isa.TORCH
    gap = float(
        (teacher_forced_logits(packed, ids)[: len(ids) - 1] - reference[: len(ids) - 1]).abs().max()
    )
    print(f"{name}: the dequantized path's largest logit gap {gap:.2e}")
    assert gap <= exact_atol
    return packed


def ct_int_group(bits: int, group: int | None, symmetric: bool, strategy: str = "group") -> dict:
    """compressed-tensors `config_groups` of int weights for every linear."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy}
    if group:
        weights["group_size"] = group
    return {"group_0": {"targets": ["Linear"], "weights": weights}}
