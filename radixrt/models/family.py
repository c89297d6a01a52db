"""How each architecture differs from Llama's decoder, read from its config once.

The families radixrt serves share one decoder skeleton (`llama.py`): embedding, per layer an
RMSNorm, attention, an RMSNorm and an MLP, a final norm and the output projection. What differs
is a few parts and where the checkpoint keeps their tensors; a `Family` names those, so the
skeleton's modules switch on a field rather than on the model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP: a router over `num_experts` experts, `top_k` of them run per token, their
    softmax weights renormalised to sum to 1 when `renormalize` (Mixtral always, Qwen3-MoE by
    `norm_topk_prob`). `prefix` and `names` (gate, up, down) say where the checkpoint keeps
    expert e: `{layer}.{prefix}.experts.{e}.{name}.weight`, its router `{layer}.{prefix}.gate`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    prefix: str
    names: tuple[str, str, str]
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class Family:
    """The parts one architecture swaps into the skeleton.

    qkv_bias: q, k and v projections have biases (Qwen2, or `attention_bias`).
    qk_norm: an RMSNorm over each head's q and k before rotary (Qwen3, Qwen3-MoE).
    fused_checkpoint: the checkpoint keeps `qkv_proj` and `gate_up_proj` fused (Phi-3/4);
        they are split by rows at load, so a tensor-parallel rank still reads only its part.
    moe: the sparse MLP on the layers it names, the dense MLP elsewhere; None when dense.
    norm_offset: added to every stored RMSNorm weight at load: Gemma's norms scale by (1 + w).
    embed_scale: the embeddings' factor (Gemma's sqrt(hidden_size)).
    activation: the gated MLP's, "silu" or Gemma's "gelu_pytorch_tanh".
    sandwich_norms: the attention's and the MLP's outputs are each normed before they join the
        residual stream, and the MLP's input by `pre_feedforward_layernorm` (Gemma).
    query_scale: q's factor before attention, so the backends' 1/sqrt(head_dim) becomes Gemma's
        1/sqrt(query_pre_attn_scalar).
    final_logit_softcap: logits become cap * tanh(logits / cap) (Gemma 2); None: unchanged.
    rope_by_layer: each layer's rotary table by layer type where the config gives one per type
        (Gemma 3's local and global theta); None: one table for every layer.
    windows: each layer's sliding window W (a query at position p sees the keys at positions
        p - W < k <= p, transformers' `sliding_window_overlay`), None where the layer attends
        globally; empty: every layer global.
    attn_logit_softcap: attention scores become cap * tanh(scores / cap) before the softmax
        (Gemma 2); None: unchanged.
    """

    qkv_bias: bool
    qk_norm: bool
    fused_checkpoint: bool
    moe: MoeSpec | None
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    activation: str = "silu"
    sandwich_norms: bool = False
    query_scale: float = 1.0
    final_logit_softcap: float | None = None
    rope_by_layer: tuple[str, ...] | None = None
    windows: tuple[int | None, ...] = ()
    attn_logit_softcap: float | None = None


QK_NORM_TYPES = {"qwen3", "qwen3_moe", "gemma3_text"}
FUSED_CHECKPOINT_TYPES = {"phi3"}
GEMMA_TYPES = {"gemma2", "gemma3_text"}
# families whose modeling code windows only the layers `layer_types` calls "sliding_attention";
# the others (Mistral, Mixtral, Phi-3, Qwen3-MoE) window every layer when `sliding_window` is set
LAYER_TYPED_WINDOWS = {"qwen2", "qwen3", "gemma2", "gemma3_text"}
ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}


def activation_of(config: PretrainedConfig) -> str:
    """The gated MLP's activation (Gemma names it `hidden_activation`); support.py refuses one
    not in ACTIVATIONS."""
    hidden_activation: str | None = getattr(config, "hidden_activation", None)
    hidden_act: str = getattr(config, "hidden_act", "silu")
    return hidden_activation or hidden_act


def family_of(config: PretrainedConfig) -> Family:
    return Family(
        qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        qk_norm=config.model_type in QK_NORM_TYPES,
        fused_checkpoint=config.model_type in FUSED_CHECKPOINT_TYPES,
        moe=_moe_of(config),
        activation=activation_of(config),
        **(_gemma_parts(config) if config.model_type in GEMMA_TYPES else {}),
        rope_by_layer=tuple(config.layer_types) if rope_per_layer_type(config) else None,
        windows=layer_windows(config),
    )


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' modeling code applies it (None: global):
    none without `sliding_window` or with `use_sliding_window` off (Qwen's switch; its
    `max_window_layers` is already folded into `layer_types` by its config class)."""
    window = getattr(config, "sliding_window", None)
    layers: int = config.num_hidden_layers
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * layers
    if config.model_type in LAYER_TYPED_WINDOWS:
        return tuple(int(window) if t == "sliding_attention" else None for t in config.layer_types)
    return (int(window),) * layers


def rope_per_layer_type(config: PretrainedConfig) -> dict[str, dict[str, Any]] | None:
    """The rope parameters by layer type where the config gives one set per type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return rope
    return None


class _GemmaParts(TypedDict, total=False):
    """The `Family` fields Gemma sets away from their defaults."""

    norm_offset: float
    embed_scale: float
    sandwich_norms: bool
    query_scale: float
    final_logit_softcap: float | None
    attn_logit_softcap: float | None


def _gemma_parts(config: PretrainedConfig) -> _GemmaParts:
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return dict(
        norm_offset=1.0,
        embed_scale=config.hidden_size**0.5,
        sandwich_norms=True,
        query_scale=(head_dim / config.query_pre_attn_scalar) ** 0.5,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
    )


def _moe_of(config: PretrainedConfig) -> MoeSpec | None:
    layers = range(config.num_hidden_layers)
    if config.model_type == "mixtral":
        return MoeSpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            prefix="block_sparse_moe",
            names=("w1", "w3", "w2"),
            sparse_layers=frozenset(layers),
        )
    if config.model_type == "qwen3_moe":
        # transformers' Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, and then
        # only every decoder_sparse_step-th layer
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            prefix="mlp",
            names=("gate_proj", "up_proj", "down_proj"),
            sparse_layers=frozenset(
                i
                for i in layers
                if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
            ),
        )
    return None
