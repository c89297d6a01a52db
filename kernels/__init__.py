"""Triton attention kernels over the paged KV token pool, with torch references."""

from .decode_attention import decode_attention_fwd
from .extend_attention import extend_attention_fwd
from .reference import decode_attention_ref, extend_attention_ref

__all__ = [
    "decode_attention_fwd",
    "extend_attention_fwd",
    "decode_attention_ref",
    "extend_attention_ref",
]
