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
- `granitehybrid` (Granite 4's -h models, dense; Bamba): attention layers named by their KV
  heads, Mamba-2's shape under `ssm.*`, Granite's scales (`embedding_scale`, `residual_scale`,
  `logit_scale`, `attention.scale`); A as -exp(A_log), D and the gated norm reshaped, the dense
  MLP as Granite's shared MLP. Files with experts are refused by name.
- mixtures of experts (`qwen3moe`, `qwen35moe`): their expert counts and widths under
  `expert_*` (transformers' table names Qwen3-MoE's experts' width not at all), and each
  layer's experts as one tensor per projection, read one expert at a time (`expert_tensors`)
  under the names a transformers checkpoint gives each expert's matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from radixrt.executor.gguf_file import GGUFFile, TensorInfo, experts
from radixrt.models.qwen3_5 import TILED_VALUE_HEADS

# llama.cpp's architecture -> transformers' model type, where transformers knows none
MODEL_TYPES = {
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "granitehybrid": "granitemoehybrid",
}
# metadata keys (after `{architecture}.`) -> config fields, added to transformers' table of
# the model type (or in its place where it has none); a field starting with "_" is derived from
# (`derived_fields`), then dropped
EXPERT_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
QWEN35_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.recurrent_layers": "_recurrent",
    "rope.freq_base": "_rope_theta",
    "rope.dimension_count": "_rotated",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "ssm.inner_size": "_value_width",
    "vocab_size": "vocab_size",
}
GRANITE_HYBRID_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "expert_shared_feed_forward_length": "shared_intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "_kv_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
    "rope.freq_base": "_rope_theta",
    "rope.dimension_count": "_rotated",
    "rope.scaling.finetuned": "_rope",
    "ssm.conv_kernel": "mamba_d_conv",
    "ssm.state_size": "mamba_d_state",
    "ssm.group_count": "mamba_n_groups",
    "ssm.time_step_rank": "mamba_n_heads",
    "ssm.inner_size": "_inner",
    "expert_count": "num_local_experts",
    "vocab_size": "vocab_size",
}
CONFIG_KEYS = {
    "qwen3_moe": EXPERT_KEYS,
    "granitemoehybrid": GRANITE_HYBRID_KEYS,
    "qwen3_5_text": QWEN35_KEYS,
    "qwen3_5_moe_text": {**QWEN35_KEYS, **EXPERT_KEYS},
}


def derived_fields(model_type: str, values: dict[str, Any]) -> None:
    """The config fields `model_type`'s GGUF metadata gives only indirectly, from `values` (the
    mapped metadata), in place; ValueError naming the key for one that cannot be."""
    if model_type == "lfm2":
        heads = values["num_key_value_heads"]
        if not isinstance(heads, list) or not heads or not all(isinstance(h, int) for h in heads):
            raise ValueError(f"lfm2.attention.head_count_kv: one count per layer, not {heads!r}")
        values["num_key_value_heads"] = max(heads)
        values["layer_types"] = ["full_attention" if h else "conv" for h in heads]
        values["block_auto_adjust_ff_dim"] = False
    elif model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        _qwen35(values)
    elif model_type == "granitemoehybrid":
        _granite_hybrid(values)


def _qwen35(values: dict[str, Any]) -> None:
    """Qwen3.5's layer types, value head width and rotary share, from the keys their metadata
    gives (each checked: a mutated file gets a ValueError naming the key)."""
    counts = ("head_dim", "linear_num_value_heads", "_value_width", "_rotated")
    if not all(isinstance(values.get(key), int) and values[key] > 0 for key in counts):
        raise ValueError(f"qwen35 GGUF metadata: {counts} must be positive counts")
    recurrent = values.pop("_recurrent", None)
    if not isinstance(recurrent, list) or len(recurrent) != values.get("num_hidden_layers"):
        raise ValueError("qwen35.attention.recurrent_layers: not one flag per layer")
    values["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]
    heads, width = values["linear_num_value_heads"], values.pop("_value_width")
    if width % heads:
        raise ValueError(f"qwen35.ssm.inner_size {width} is not a multiple of {heads} heads")
    values["linear_value_head_dim"] = width // heads
    rotated, head_dim = values.pop("_rotated"), values["head_dim"]
    if rotated > head_dim:
        raise ValueError(f"qwen35.rope.dimension_count {rotated} exceeds a head of {head_dim}")
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": values.pop("_rope_theta", 10000.0),
        "partial_rotary_factor": rotated / head_dim,
    }
    values[TILED_VALUE_HEADS] = True


def _granite_hybrid(values: dict[str, Any]) -> None:
    """Granite 4's (and Bamba's) hybrid: attention layers named by their KV heads (0 for a
    Mamba-2 layer), the Mamba heads' width from the inner size, positions rotated only where
    `rope.scaling.finetuned` says (the -h models rotate none), attention scaled by
    `attention.scale` (1/sqrt(head dim) where absent), the other scales 1 where absent."""
    if values.get("num_local_experts"):
        raise ValueError(
            "granitehybrid GGUF files with experts are not read yet; serve the model's "
            "safetensors checkpoint"
        )
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
    head_dim = hidden // values["num_attention_heads"]
    rotated = values.pop("_rotated", head_dim)
    values["position_embedding_type"] = "rope" if values.pop("_rope", False) else "nope"
    values["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": values.pop("_rope_theta", 10000.0),
        "partial_rotary_factor": min(rotated, head_dim) / head_dim,
    }
    values.setdefault("attention_multiplier", head_dim**-0.5)
    values["num_local_experts"] = 0


@dataclass
class Processed:
    """A tensor as transformers' layout holds it (the shape of its GGUF tensor processors'
    results)."""

    weights: np.ndarray


class Qwen35Tensors:
    """Qwen3.5's tensors as llama.cpp's converter wrote them, changed back to transformers'
    (but for the value heads' order: see the module's docstring)."""

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


class GraniteHybridTensors:
    """A Mamba-2 layer's tensors as llama.cpp's converter wrote them, changed back: A as
    -exp(A_log) and D each [1, heads], the convolution as [channels, taps], the gated norm's
    weight by groups [groups, width / groups]."""

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
    "granitehybrid": GraniteHybridTensors,
}
# a checkpoint tensor the file keeps as several (stacked by rows), or under another name than
# gguf's table gives it, by architecture: its name after `model.layers.{i}.` -> the file's
# tensors after `blk.{i}.` (Granite 4's shared MLP, which a dense file keeps as its MLP)
COMPOSED = {
    "granitehybrid": {
        "shared_mlp.input_linear.weight": ("ffn_gate.weight", "ffn_up.weight"),
        "shared_mlp.output_linear.weight": ("ffn_down.weight",),
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
