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
MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
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
CONFIG_KEYS = {
    "qwen3_moe": EXPERT_KEYS,
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


PROCESSORS = {"qwen35": Qwen35Tensors, "qwen35moe": Qwen35Tensors}
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
