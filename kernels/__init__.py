"""Hand-written kernels: Triton attention over the paged KV token pool (GPU) with torch
references, Triton's fused MoE projections, LoRA deltas (GPU; the deltas' CPU path is
`lora`) and weight-only GEMM over the packed weights (`packed_gemm`), and C kernels for the
CPU built on first use (`native`, `cpu_paged`, `cpu_fused`, `cpu_mask`, `int8_gemm`), their C
in `csrc/`.

The Triton names load on first access, so the CPU kernels import without Triton.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "causal_conv_fwd": ".causal_conv",
    "decode_attention_fwd": ".decode_attention",
    "extend_attention_fwd": ".extend_attention",
    "fused_moe_fwd": ".fused_moe",
    "gated_delta_fwd": ".gated_delta",
    "lora_sgmv_fwd": ".lora_sgmv",
    "packed_linear_fwd": ".packed_gemm",
    "ssd_fwd": ".ssd",
    "decode_attention_ref": ".reference",
    "extend_attention_ref": ".reference",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
