"""What a checkpoint asks for that radixrt cannot honour is refused at load, in one line naming
the field: a model that loads must never run silently wrong."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# rope types whose tables depend only on the position (computed once, for every position):
# "dynamic" and "longrope" rescale by the sequence's length, which one table cannot follow
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
# tensors a Hugging Face checkpoint may carry that the model recomputes or ties
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def sliding_window(config) -> int | None:
    """The attention window the checkpoint asks for, None when attention is global."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def check_supported(config, context_length: int | None) -> int:
    """The context length to serve (`context_length` as given, else the checkpoint's), after
    refusing what cannot be honoured: a `quantization_config`, a rope type whose table depends
    on the sequence's length, or a sliding window shorter than the context asked for. Without an
    explicit context length a sliding window caps the context at the window, where attending to
    the window is attending to everything: exact."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else type(quant).__name__
        raise ValueError(
            f"config.json: quantization_config ({method}) is not supported; load a float "
            "checkpoint (and use --quantization int8 for int8 weights)"
        )
    kind = rope_type(config)
    if kind not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling type {kind!r} is not supported "
            f"(supported: {sorted(STATIC_ROPE_TYPES)})"
        )
    window = sliding_window(config)
    longest = context_length or config.max_position_embeddings
    if window is None or window >= longest:
        return longest
    if context_length:
        raise ValueError(
            f"config.json: sliding_window {window} is shorter than --context-length "
            f"{context_length}; sliding-window attention is not implemented yet"
        )
    logger.warning(
        "sliding_window %d: serving a context of %d tokens (not %d), within which attention "
        "is exact",
        window,
        window,
        config.max_position_embeddings,
    )
    return window


def check_all_read(names: set[str], read: set[str], tied: bool) -> None:
    """Every checkpoint tensor was loaded: one nobody read means a layer the model lacks."""
    ignorable = {"lm_head.weight"} if tied else set()
    unused = sorted(n for n in names - read - ignorable if not n.endswith(IGNORABLE_SUFFIXES))
    if unused:
        raise ValueError(
            f"the checkpoint has {len(unused)} tensors this architecture does not use, "
            f"e.g. {unused[:4]}"
        )
