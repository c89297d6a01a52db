"""What radixrt reads of GGUF families beyond transformers' GGUF tables: where llama.cpp's
converter writes a family's metadata or tensors in a way transformers does not read (or reads
for an older layout), the config fields it derives and the tensors' changes undone.

- `lfm2`: its attention layers are named by their KV heads, one count per layer (0 for a short
  convolution), and its MLP width is stored as used (not to be adjusted again).
- `qwen35` (Qwen3.5 text, dense): not in transformers' tables at all. Metadata: the Gated
  DeltaNet's shape under `ssm.*` (`group_count` key heads, `time_step_rank` value heads,
  `state_size` the key width, `inner_size` all value heads' width), `attention.recurrent_layers`
  which layers are linear attention, `rope.dimension_count` the rotated dims of a head. Tensors:
  every RMSNorm weight but the Gated DeltaNet's own is stored plus 1 (the converter folds in the
  norms' 1 + w), A as -exp(A_log), the convolution as [channels, taps]; and the value heads in
  llama.cpp's tiled order (value head h reads key head h mod key heads), which the model is told
  to read as such (`qwen3_5.TILED_VALUE_HEADS`) rather than reordering every value projection,
  so the quantized linears are served packed as stored. `qwen35moe` as `qwen35`, with experts.
- `qwen3next` (Qwen3-Next) as `qwen35moe`, but for its Gated DeltaNet's fused projections: the
  converter leaves the value heads grouped by key head (transformers' order) and `in_proj_ba`
  as it is (`ssm_ba`: per key head, its value heads' b rows, then their a rows), and splits
  `in_proj_qkvz`, interleaved by key head, into every head's q, k and v rows (`attn_qkv`, as
  Qwen3.5's `in_proj_qkv`) and their z rows (`attn_gate`). Those two are read as
  `in_proj_qkvz` stacked (`COMPOSED`), which the model is told holds its rows by projection
  (`qwen3_5.QKVZ_BY_PROJECTION`): `attn_qkv` and `attn_gate` are served packed as stored as
  the model's own q/k/v and z projections; b and a, rows interleaved in one tensor, as float.
- `granitehybrid` (Granite 4's -h models; Bamba): attention layers named by their KV heads,
  Mamba-2's shape under `ssm.*`, Granite's scales (`embedding_scale`, `residual_scale`,
  `logit_scale`, `attention.scale`); A as -exp(A_log), D and the gated norm reshaped. A dense
  file keeps Granite's shared MLP as its MLP (`ffn_gate`, `ffn_up`, `ffn_down`); one with
  experts (-h-tiny, -h-small) keeps it as a shared expert (`ffn_*_shexp`) and its experts as
  tensors of every expert's, which Granite's checkpoints stack otherwise (`STACKED_EXPERTS`).
- `falcon-h1` (Falcon-H1): the converter folds every one of its μP multipliers into the
  tensors they scale (the embedding, the output projection, q, k, v, o, the Mamba-2 in and out
  projections by part, the MLP's gate and down) and writes none as metadata: the config sets
  each to 1, so none is applied twice. Which optional parts a layer has (the gated norm, biases)
  no key names: they are read from the tensors the file holds (`FALCON_H1_PARTS`); the gated
  norm as llama.cpp applies it, after the gate. Its Mamba-2 tensors as `granitehybrid`'s.
- mixtures of experts (`qwen3moe`, `qwen35moe`, `qwen3next`, `granitehybrid`): their expert
  counts and widths under `expert_*` (transformers' table names Qwen3-MoE's experts' width not
  at all), and each layer's experts as one tensor per projection, read one expert at a time
  (`expert_tensors`) under the names a transformers checkpoint gives each expert's matrix.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixrt.executor.gguf_file import GGUFFile, TensorInfo, experts
from radixrt.models.qwen3_5 import QKVZ_BY_PROJECTION, TILED_VALUE_HEADS

# llama.cpp's architecture -> transformers' model type, where transformers knows none
MODEL_TYPES = {
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "granitehybrid": "granitemoehybrid",
    "falcon-h1": "falcon_h1",
}
ARCHITECTURES = {model_type: arch for arch, model_type in MODEL_TYPES.items()}  # in messages
# metadata keys (after `{architecture}.`) -> config fields, added to transformers' table of
# the model type (or in its place where it has none); a field starting with "_" is derived from
# (`derived_fields`), then dropped
EXPERT_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# the transformer's own shape, as every family below keys it
SHAPE_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "_rope_theta",
    "vocab_size": "vocab_size",
}
QWEN35_KEYS = {
    **SHAPE_KEYS,
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.recurrent_layers": "_recurrent",
    "rope.dimension_count": "_rotated",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "ssm.inner_size": "_value_width",
}
GRANITE_HYBRID_KEYS = {
    **SHAPE_KEYS,
    "expert_shared_feed_forward_length": "shared_intermediate_size",
    "attention.head_count_kv": "_kv_heads",
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
    "rope.dimension_count": "_rotated",
    "rope.scaling.finetuned": "_rope",
    "ssm.conv_kernel": "mamba_d_conv",
    "ssm.state_size": "mamba_d_state",
    "ssm.group_count": "mamba_n_groups",
    "ssm.time_step_rank": "mamba_n_heads",
    "ssm.inner_size": "_inner",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}
FALCON_H1_KEYS = {
    **SHAPE_KEYS,
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "ssm.conv_kernel": "mamba_d_conv",
    "ssm.state_size": "mamba_d_state",
    "ssm.group_count": "mamba_n_groups",
    "ssm.time_step_rank": "mamba_n_heads",
    "ssm.inner_size": "mamba_d_ssm",
}
CONFIG_KEYS = {
    "qwen3_moe": EXPERT_KEYS,
    "granitemoehybrid": GRANITE_HYBRID_KEYS,
    "qwen3_5_text": QWEN35_KEYS,
    "qwen3_5_moe_text": {**QWEN35_KEYS, **EXPERT_KEYS},
    "qwen3_next": {**QWEN35_KEYS, **EXPERT_KEYS},
    "falcon_h1": FALCON_H1_KEYS,
}
# Falcon-H1's multipliers, each folded into the tensors it scales by the converter (the
# module's docstring): 1 in the config of a file
FALCON_H1_FOLDED = {
    "embedding_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "key_multiplier": 1.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0,
    "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0,
    "mlp_multipliers": [1.0, 1.0],
    "ssm_multipliers": [1.0] * 5,
}
# Falcon-H1's optional parts, which no metadata key names: a config flag -> the tensor (of every
# layer, after `blk.0.`) a file holds where it is set
FALCON_H1_PARTS = {
    "mamba_rms_norm": "ssm_norm.weight",
    "mamba_conv_bias": "ssm_conv1d.bias",
    "mamba_proj_bias": "ssm_in.bias",
    "projectors_bias": "ssm_out.bias",
}


def derived_fields(model_type: str, values: dict[str, Any], tensors: Collection[str]) -> None:
    """The config fields `model_type`'s GGUF metadata gives only indirectly, from `values` (the
    mapped metadata) and the names of the file's `tensors`, in place; ValueError naming the key
    for one that cannot be."""
    if model_type == "lfm2":
        heads = values["num_key_value_heads"]
        if not isinstance(heads, list) or not heads or not all(isinstance(h, int) for h in heads):
            raise ValueError(f"lfm2.attention.head_count_kv: one count per layer, not {heads!r}")
        values["num_key_value_heads"] = max(heads)
        values["layer_types"] = ["full_attention" if h else "conv" for h in heads]
        values["block_auto_adjust_ff_dim"] = False
    elif model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        _qwen35(values, ARCHITECTURES[model_type])
        values[TILED_VALUE_HEADS] = True
    elif model_type == "qwen3_next":
        _qwen35(values, ARCHITECTURES[model_type])
        values[QKVZ_BY_PROJECTION] = True
    elif model_type == "granitemoehybrid":
        _granite_hybrid(values)
    elif model_type == "falcon_h1":
        _falcon_h1(values, tensors)


def _qwen35(values: dict[str, Any], arch: str) -> None:
    """Qwen3.5's (and Qwen3-Next's) layer types, value head width and rotary share, from the
    keys their metadata (of llama.cpp's `arch`) gives (each checked: a mutated file gets a
    ValueError naming the key)."""
    counts = ("head_dim", "linear_num_value_heads", "_value_width", "_rotated")
    if not all(isinstance(values.get(key), int) and values[key] > 0 for key in counts):
        raise ValueError(f"{arch} GGUF metadata: {counts} must be positive counts")
    recurrent = values.pop("_recurrent", None)
    if not isinstance(recurrent, list) or len(recurrent) != values.get("num_hidden_layers"):
        raise ValueError(f"{arch}.attention.recurrent_layers: not one flag per layer")
    values["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]
    heads, width = values["linear_num_value_heads"], values.pop("_value_width")
    if width % heads:
        raise ValueError(f"{arch}.ssm.inner_size {width} is not a multiple of {heads} heads")
    values["linear_value_head_dim"] = width // heads
    rotated, head_dim = values.pop("_rotated"), values["head_dim"]
    if rotated > head_dim:
        raise ValueError(f"{arch}.rope.dimension_count {rotated} exceeds a head of {head_dim}")
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": values.pop("_rope_theta", 10000.0),
        "partial_rotary_factor": rotated / head_dim,
    }


def _granite_hybrid(values: dict[str, Any]) -> None:
    """Granite 4's (and Bamba's) hybrid: attention layers named by their KV heads (0 for a
    Mamba-2 layer), the Mamba heads' width from the inner size, positions rotated only where
    `rope.scaling.finetuned` says (the -h models rotate none), attention scaled by
    `attention.scale` (1/sqrt(head dim) where absent), the other scales 1 where absent; no
    experts where `expert_count` is absent or 0, else top `expert_used_count` of them."""
    experts, top_k = values.setdefault("num_local_experts", 0), values.get("num_experts_per_tok")
    if experts and not (isinstance(top_k, int) and 0 < top_k <= experts):
        raise ValueError(f"granitehybrid.expert_used_count: not 1 to {experts} experts a token")
    counts = ("hidden_size", "num_attention_heads", "mamba_n_heads", "_inner")
    if not all(isinstance(values.get(key), int) and values[key] > 0 for key in counts):
        raise ValueError(f"granitehybrid GGUF metadata: {counts} must be positive counts")
    heads = values.pop("_kv_heads", None)
    if not isinstance(heads, list) or len(heads) != values.get("num_hidden_layers"):
        raise ValueError("granitehybrid.attention.head_count_kv: not one count per layer")
    values["num_key_value_heads"] = max(heads) or values["num_attention_heads"]
    values["layer_types"] = ["full_attention" if h else "linear_attention" for h in heads]
    inner, mamba_heads, hidden = (
        values.pop("_inner"),
        values["mamba_n_heads"],
        values["hidden_size"],
    )
    if inner % mamba_heads:
        raise ValueError(f"granitehybrid.ssm.inner_size {inner} is not a multiple of {mamba_heads}")
    if inner % hidden:
        raise ValueError(f"granitehybrid.ssm.inner_size {inner} is not a multiple of {hidden}")
    values["mamba_d_head"], values["mamba_expand"] = inner // mamba_heads, inner // hidden
    attention_heads = values["num_attention_heads"]
    if hidden % attention_heads:
        raise ValueError(
            f"granitehybrid.embedding_length {hidden} is not a multiple of {attention_heads}"
        )
    head_dim = hidden // attention_heads
    rotated = values.pop("_rotated", head_dim)
    values["position_embedding_type"] = "rope" if values.pop("_rope", False) else "nope"
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": values.pop("_rope_theta", 10000.0),
        "partial_rotary_factor": min(rotated, head_dim) / head_dim,
    }
    values.setdefault("attention_multiplier", head_dim**-0.5)


def _falcon_h1(values: dict[str, Any], tensors: Collection[str]) -> None:
    """Falcon-H1's Mamba heads' width from the inner size, its multipliers 1 (`FALCON_H1_FOLDED`),
    its optional parts by the tensors the file holds (`FALCON_H1_PARTS`), the gated norm after
    the gate (where llama.cpp applies it)."""
    counts = ("hidden_size", "mamba_n_heads", "mamba_d_ssm")
    if not all(isinstance(values.get(key), int) and values[key] > 0 for key in counts):
        raise ValueError(f"falcon-h1 GGUF metadata: {counts} must be positive counts")
    inner, heads = values["mamba_d_ssm"], values["mamba_n_heads"]
    if inner % heads:
        raise ValueError(f"falcon-h1.ssm.inner_size {inner} is not a multiple of {heads} heads")
    values["mamba_d_head"] = inner // heads
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": values.pop("_rope_theta", 10000.0),
    }
    values.update(copy.deepcopy(FALCON_H1_FOLDED))
    for flag, tensor in FALCON_H1_PARTS.items():
        values[flag] = f"blk.0.{tensor}" in tensors
    values["mamba_norm_before_gate"] = False


@dataclass
class Processed:
    """A tensor as transformers' layout holds it (the shape of its GGUF tensor processors'
    results)."""

    weights: np.ndarray


class Qwen35Tensors:
    """Qwen3.5's (and Qwen3-Next's) tensors as llama.cpp's converter wrote them, changed back to
    transformers' (but for the order of Qwen3.5's value heads and of Qwen3-Next's fused rows:
    see the module's docstring)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def process(self, weights: np.ndarray, name: str, **_: Any) -> Processed:
        if name.endswith(".ssm_a"):  # -exp(A_log)
            weights = np.log(-weights)
        elif name.endswith(".ssm_conv1d.weight"):  # [channels, taps] -> [channels, 1, taps]
            weights = weights[:, None, :]
        elif name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight"):
            weights = weights - 1.0
        return Processed(weights)


class Mamba2Tensors:
    """A Mamba-2 layer's tensors as llama.cpp's converter wrote them (Granite 4's, Falcon-H1's),
    changed back: A as -exp(A_log) and D each [1, heads], the convolution as [channels, taps],
    the gated norm's weight by groups [groups, width / groups]."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def process(self, weights: np.ndarray, name: str, **_: Any) -> Processed:
        if name.endswith(".ssm_a"):
            weights = np.log(-weights).reshape(-1)
        elif name.endswith((".ssm_d", ".ssm_norm.weight")):
            weights = weights.reshape(-1)
        elif name.endswith(".ssm_conv1d.weight"):
            weights = weights[:, None, :]
        return Processed(weights)


PROCESSORS = {
    "qwen35": Qwen35Tensors,
    "qwen35moe": Qwen35Tensors,
    "qwen3next": Qwen35Tensors,
    "granitehybrid": Mamba2Tensors,
    "falcon-h1": Mamba2Tensors,
}
# a checkpoint tensor the file keeps as several (stacked by rows), or under another name than
# gguf's table gives it, by architecture: its name after `model.layers.{i}.` -> the file's
# tensors after `blk.{i}.`, the first of the choices the file holds (Granite 4's shared MLP, which
# a dense file keeps as its MLP and one with experts as a shared expert, whose down projection
# gguf's table names; Qwen3-Next's `in_proj_qkvz`, by projection: the module's docstring)
COMPOSED: dict[str, dict[str, tuple[tuple[str, ...], ...]]] = {
    "granitehybrid": {
        "shared_mlp.input_linear.weight": (
            ("ffn_gate.weight", "ffn_up.weight"),
            ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
        ),
        "shared_mlp.output_linear.weight": (("ffn_down.weight",),),
    },
    "qwen3next": {"linear_attn.in_proj_qkvz.weight": (("attn_qkv.weight", "attn_gate.weight"),)},
}
# names transformers' model gives a layer's parameters (the skeleton `GGUFWeightReader` reads
# by) where its checkpoints, which radixrt's models read, give others: by architecture, after
# `model.layers.{i}.` (Granite 4's router and experts)
CHECKPOINT_NAMES = {
    "granitehybrid": {
        "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
        "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    }
}
# a layer's experts where its checkpoints stack them, one tensor [E, rows, K] (Granite 4's):
# by architecture, the tensor's name after `model.layers.{i}.` -> the projections (`EXPERTS`'
# names) of each expert's matrices (`expert_tensors`) whose rows stack into its row e
STACKED_EXPERTS = {
    "granitehybrid": {
        "block_sparse_moe.input_linear.weight": ("gate_proj", "up_proj"),
        "block_sparse_moe.output_linear.weight": ("down_proj",),
    }
}
# llama.cpp's tensors of every expert of a layer -> the projection each expert's slice is in
# transformers' checkpoints (`{layer}.mlp.experts.{e}.{projection}.weight`) and in radixrt's
# model (fused: gate and up rows in `gate_up_proj`)
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def expert_tensors(file: GGUFFile) -> dict[str, TensorInfo]:
    """Each expert's matrix in `file` (`gguf_file.experts`) by its name in a transformers
    checkpoint, `model.layers.{i}.mlp.experts.{e}.{projection}.weight`: the names the
    decoder reads experts by (`Decoder._load_experts`)."""
    found = {}
    for tensor in file.tensors.values():
        block, _, rest = tensor.name.partition(".")
        layer, _, kind = rest.partition(".")
        projection = EXPERTS.get(kind.removesuffix(".weight"))
        if block != "blk" or projection is None or not kind.endswith(".weight"):
            continue
        for e, part in enumerate(experts(tensor)):
            found[f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"] = part
    return found


# transformers' parameter names (after the layer's module) that the converter renamed before
# gguf's table maps them: ours -> the name the table knows, and the kind it is stored under
RENAMED_PARAMETERS = {"dt_bias": ("dt_proj", "bias")}
