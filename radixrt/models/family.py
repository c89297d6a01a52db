"""How each architecture differs from Llama's decoder, read from its config once.

The families radixrt serves share one decoder skeleton (`llama.py`): embedding, per layer an
RMSNorm, attention, an RMSNorm and an MLP, a final norm and the output projection. What differs
is a few parts and where the checkpoint keeps their tensors; a `Family` names those, so the
skeleton's modules switch on a field rather than on the model type.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    qkv_bias: bool
    qk_norm: bool
    fused_checkpoint: bool
    moe: MoeSpec | None


QK_NORM_TYPES = {"qwen3", "qwen3_moe"}
FUSED_CHECKPOINT_TYPES = {"phi3"}


def family_of(config) -> Family:
    return Family(
        qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        qk_norm=config.model_type in QK_NORM_TYPES,
        fused_checkpoint=config.model_type in FUSED_CHECKPOINT_TYPES,
        moe=_moe_of(config),
    )


def _moe_of(config) -> MoeSpec | None:
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
