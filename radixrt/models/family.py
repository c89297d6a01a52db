"""How each architecture differs from Llama's decoder, read from its config once.

The attention-only families radixrt serves share one decoder (`decoder.py`): embedding, per
layer an RMSNorm, attention, an RMSNorm and an MLP, a final norm and the output projection. What
differs is a few parts and where the checkpoint keeps their tensors; a `Family` names those, and
each family's module (`llama.py`, `qwen.py`, `gemma.py`, ...) builds its own, so the shared
layers switch on a field rather than on the model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP: a router over `num_experts` experts, `top_k` of them run per token, their
    softmax weights renormalised to sum to 1 when `renormalize` (Mixtral always, Qwen3-MoE by
    `norm_topk_prob`). `prefix` and `names` (gate, up, down) say where the checkpoint keeps
    expert e: `{layer}.{prefix}.experts.{e}.{name}.weight`, its router `{layer}.{prefix}.gate`.
    (Granite 4's checkpoint stacks every expert's tensors in one; its class reads them.)
    `shared_intermediate_size`: the width of a shared expert every token runs besides its
    routed ones, its output scaled by sigmoid(`shared_expert_gate`(x)) (Qwen3-Next, Qwen3.5-MoE:
    `{layer}.{prefix}.shared_expert.{name}.weight`), or added as it is where not `shared_gate`
    (Granite 4's shared MLP); 0: none. `top_k_first`: the k largest router logits are picked
    first and softmaxed among themselves (Granite 4): the renormalised weights, but summed as
    transformers sums that family's, and picked from the logits, not from their rounded
    probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    prefix: str
    names: tuple[str, str, str]
    sparse_layers: frozenset[int]
    shared_intermediate_size: int = 0
    shared_gate: bool = True
    top_k_first: bool = False


@dataclass(frozen=True)
class Family:
    """The parts one architecture swaps into the skeleton.

    qkv_bias: q, k and v projections have biases (Qwen2, or `attention_bias`).
    qk_norm: an RMSNorm over each head's q and k before rotary (Qwen3, Qwen3-MoE).
    fused_checkpoint: which of `qkv_proj` and `gate_up_proj` the checkpoint keeps fused (both:
        Phi-3/4; `gate_up_proj`: Granite 4's shared MLP); they are split by rows at load, so a
        tensor-parallel rank still reads only its part.
    moe: the sparse MLP on the layers it names, the dense MLP elsewhere; None when dense.
    norm_offset: added to every stored RMSNorm weight at load: Gemma's norms scale by (1 + w).
    embed_scale: the embeddings' factor (Gemma's sqrt(hidden_size)).
    activation: the gated MLP's, "silu" or Gemma's "gelu_pytorch_tanh".
    sandwich_norms: the attention's and the MLP's outputs are each normed before they join the
        residual stream, and the MLP's input by `pre_feedforward_layernorm` (Gemma).
    query_scale: q's factor before attention, so the backends' 1/sqrt(head_dim) becomes Gemma's
        1/sqrt(query_pre_attn_scalar).
    final_logit_softcap: logits become cap * tanh(logits / cap) (Gemma 2); None: unchanged.
    norm_eps: every RMSNorm's epsilon (the config's `rms_norm_eps`, LFM2's `norm_eps`).
    rope_by_layer: each layer's rotary table by layer type where the config gives one per type
        (Gemma 3's local and global theta); None: one table for every layer.
    windows: each layer's sliding window W (a query at position p sees the keys at positions
        p - W < k <= p, transformers' `sliding_window_overlay`), None where the layer attends
        globally; empty: every layer global. A model keeps its attention layers' only, in the
        order of the KV pool's layers, by which the attention backend reads them.
    attn_logit_softcap: attention scores become cap * tanh(scores / cap) before the softmax
        (Gemma 2); None: unchanged.
    attn_output_gate: q_proj holds each head's query then as many gate rows; the attention's
        output is multiplied by sigmoid(gate) before o_proj (Qwen3.5, Qwen3-Next).
    rotary: the attention rotates q and k by position; False: no positions at all, the tables
        rotating none of each head's dims (Granite 4's `position_embedding_type` "nope").
    residual_scale: the mixer's and the MLP's outputs are multiplied by it before each joins
        the residual stream (Granite 4's `residual_multiplier`); not with sandwich norms.
    logits_divisor: the logits are divided by it (Granite 4's `logits_scaling`), before any
        soft-cap.
    logits_scale: the logits are multiplied by it (Falcon-H1's `lm_head_multiplier`), as
        transformers multiplies: not a divisor, whose reciprocal would round otherwise.
    key_scale: each key's factor as projected, before rotary (Falcon-H1's `key_multiplier`).
    mlp_scales: the dense MLP's gate projection's output is multiplied by the first before the
        activation, the MLP's output by the second (Falcon-H1's `mlp_multipliers`).
    """

    qkv_bias: bool
    qk_norm: bool
    fused_checkpoint: frozenset[str]
    moe: MoeSpec | None
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    activation: str = "silu"
    sandwich_norms: bool = False
    query_scale: float = 1.0
    final_logit_softcap: float | None = None
    norm_eps: float = 1e-6
    rope_by_layer: tuple[str, ...] | None = None
    windows: tuple[int | None, ...] = ()
    attn_logit_softcap: float | None = None
    attn_output_gate: bool = False
    rotary: bool = True
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    logits_scale: float = 1.0
    key_scale: float = 1.0
    mlp_scales: tuple[float, float] = (1.0, 1.0)


ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}


def activation_of(config: PretrainedConfig) -> str:
    """The gated MLP's activation (Gemma names it `hidden_activation`); support.py refuses one
    not in ACTIVATIONS."""
    hidden_activation: str | None = getattr(config, "hidden_activation", None)
    hidden_act: str = getattr(config, "hidden_act", "silu")
    return hidden_activation or hidden_act


def decoder_family(
    config: PretrainedConfig,
    *,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    fused_checkpoint: frozenset[str] = frozenset(),
    moe: MoeSpec | None = None,
    windows_by_layer_type: bool = False,
    **parts: Any,
) -> Family:
    """The `Family` of an attention decoder with what its module names (`parts`: the other
    fields of `Family`) and what every family reads alike: q/k/v biases where the config sets
    `attention_bias`, the activation, rotary tables by layer type where the config gives them,
    and the sliding windows (`layer_windows`)."""
    if "norm_eps" not in parts:
        parts["norm_eps"] = config.rms_norm_eps
    return Family(
        qkv_bias=qkv_bias or bool(getattr(config, "attention_bias", False)),
        qk_norm=qk_norm,
        fused_checkpoint=fused_checkpoint,
        moe=moe,
        activation=activation_of(config),
        rope_by_layer=tuple(config.layer_types) if rope_per_layer_type(config) else None,
        windows=layer_windows(config, windows_by_layer_type),
        **parts,
    )


def layer_windows(config: PretrainedConfig, by_layer_type: bool) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' modeling code applies it (None: global):
    none without `sliding_window` or with `use_sliding_window` off (Qwen's switch; its
    `max_window_layers` is already folded into `layer_types` by its config class); where the
    family's code windows only the layers `layer_types` calls "sliding_attention"
    (`by_layer_type`: Qwen2/3, Gemma 2/3) those, else every layer (Mistral, Mixtral, Phi-3,
    Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None)
    layers: int = config.num_hidden_layers
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * layers
    if by_layer_type:
        return tuple(int(window) if t == "sliding_attention" else None for t in config.layer_types)
    return (int(window),) * layers


def rope_per_layer_type(config: PretrainedConfig) -> dict[str, dict[str, Any]] | None:
    """The rope parameters by layer type where the config gives one set per type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return rope
    return None
