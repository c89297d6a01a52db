"""What a checkpoint asks for that radixrt cannot honour is refused at load, in one line naming
the field: a model that loads must never run silently wrong."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixrt.models.family import ACTIVATIONS, activation_of, rope_per_layer_type
from radixrt.models.quantized import CheckpointQuant

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# rope types whose tables depend only on the position (computed once, for every position):
# "dynamic" rescales by the sequence's length, which one table cannot follow; "longrope" uses
# its short factors up to original_max_position_embeddings (and the long ones past it), so its
# short-factor table is exact within that context (see `exact_limits`)
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}
# the longest context a checkpoint may claim (Llama 4 Scout's 10M is below it): past it, a
# broken or hostile config would size rotary tables of gigabytes before anything is served
MAX_CONTEXT = 1 << 24
# fields that change the attention itself, which the attention backends do not compute
UNSUPPORTED_FIELDS = {"use_bidirectional_attention": "attention is causal"}
# tensors a Hugging Face checkpoint may carry that the model recomputes or ties
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def rope_parameters(config: PretrainedConfig) -> list[dict[str, Any]]:
    """The config's rope parameters: one set, or one per layer type (Gemma 3's local and
    global)."""
    per_type = rope_per_layer_type(config)
    if per_type:
        return list(per_type.values())
    return [getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}]


def rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"


def exact_limits(config: PretrainedConfig) -> list[tuple[int, str, str]]:
    """(longest exact context, the field that limits it, why) for each such field: longrope's
    original_max_position_embeddings (transformers switches to the long factors past it).
    Sliding windows are attended as such (`family.layer_windows`): they limit nothing."""
    limits = []
    for rope in rope_parameters(config):
        if rope_type(rope) != "longrope":
            continue
        original = int(
            rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
        )
        limits.append(
            (
                original,
                f"rope_scaling longrope original_max_position_embeddings {original}",
                "past it longrope switches factors by the sequence's length",
            )
        )
    return limits


def check_supported(config: PretrainedConfig, context_length: int | None) -> int:
    """The context length to serve (`context_length` as given, else the checkpoint's), after
    refusing what cannot be honoured: a `quantization_config` radixrt cannot read packed
    (GPTQ, AWQ and compressed-tensors it can: `models/quantized.py`), a rope type whose table depends
    on the sequence's length, an MLP activation not computed, a field that changes the attention
    itself (`UNSUPPORTED_FIELDS`: bidirectional attention), or a context asked for
    beyond what longrope serves exactly (`exact_limits`). Without an explicit context length
    that caps the context, within which radixrt's rotary tables are transformers': exact."""
    CheckpointQuant.of(config)  # refuses what cannot be read packed (models/quantized.py)
    for kind in map(rope_type, rope_parameters(config)):
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"config.json: rope_scaling type {kind!r} is not supported "
                f"(supported: {sorted(STATIC_ROPE_TYPES)})"
            )
    activation = activation_of(config)
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"config.json: hidden_act {activation!r} is not supported "
            f"(supported: {sorted(ACTIVATIONS)})"
        )
    for name, why in UNSUPPORTED_FIELDS.items():
        if getattr(config, name, None):
            raise ValueError(f"config.json: {name} is not supported ({why})")
    longest = context_length or config.max_position_embeddings
    if not 0 < longest <= MAX_CONTEXT:
        field = "--context-length" if context_length else "config.json: max_position_embeddings"
        raise ValueError(f"{field} {longest} is not between 1 and {MAX_CONTEXT:,} tokens")
    limits = [limit for limit in exact_limits(config) if limit[0] < longest]
    if not limits:
        return longest
    limit, field, why = min(limits)
    if context_length:
        raise ValueError(
            f"config.json: {field} is shorter than --context-length {context_length}; {why}"
        )
    logger.warning(
        "%s: serving a context of %d tokens (not %d), within which the model is exact",
        field,
        limit,
        config.max_position_embeddings,
    )
    return limit


def check_all_read(names: set[str], read: set[str], tied: bool) -> None:
    """Every checkpoint tensor was loaded: one nobody read means a layer the model lacks."""
    ignorable = {"lm_head.weight"} if tied else set()
    unused = sorted(n for n in names - read - ignorable if not n.endswith(IGNORABLE_SUFFIXES))
    if unused:
        raise ValueError(
            f"the checkpoint has {len(unused)} tensors this architecture does not use, "
            f"e.g. {unused[:4]}"
        )
