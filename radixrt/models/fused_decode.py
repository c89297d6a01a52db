"""Which decode steps run their layers in one native call (`kernels/cpu_layer`), and the call.

A model qualifies once, at its first step: the attention decoder's layer (`decoder.py`) as the
per-op path runs it (RMSNorms,
RoPE over whole heads, SiLU, no q/k norms, sandwich norms, experts, soft-caps, sliding windows,
query, key, residual or MLP scaling), on one rank, float32 on the CPU, its four linears a layer grouped (4 to 16-bit)
weights or int8 channels on a native `--cpu-isa` path with no bias, input permutation or
adapter, and a float32 KV pool read in place. A step qualifies when every row attends as a
decode row with no shared prefix split off (`TorchMetadata`): one stream, or several without a
common start. Every other step keeps the per-op path, which gives the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from radixrt.attention.torch_backend import TorchAttentionBackend, TorchMetadata
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_layer, cpu_paged
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.interface import Projection
from radixrt.models.linear import GroupedLinear, Int8Linear

SITES = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the order `cpu_layer` takes them


@dataclass
class FusedDecode:
    """A qualifying model's layer records, rebuilt when what they point at moves: the pool's
    buffers (a release and restore of the KV memory) or a packed weight (a weight update
    replaces it)."""

    model: Any  # the `decoder.Decoder` (its layers' norms, read here)
    sites: list[Projection]  # each layer's qkv, o, gate_up and down, layer after layer
    shape: cpu_layer.Shape
    isa: Isa
    _layers: ctypes.Array[cpu_layer.Layer] | None = field(default=None, init=False)
    _held: list[Any] = field(default_factory=list, init=False)  # what the records point at

    @classmethod
    def of(cls, model: Any) -> FusedDecode | None:
        """The model's fused path, or None where a layer does not qualify (the module's
        docstring)."""
        family, cfg = model.family, model.config
        plain = (
            model.tp.size == 1
            and not family.qk_norm
            and not family.sandwich_norms
            and family.moe is None
            and family.query_scale == 1.0
            and family.residual_scale == 1.0
            and family.key_scale == 1.0
            and family.mlp_scales == (1.0, 1.0)
            and family.attn_logit_softcap is None
            and family.activation == "silu"
            and all(w is None for w in family.windows)
            and set(model.rope_of_layer) == {"all"}
            and model.rope["all"].cos.shape[-1] == model.head_dim
            and model.head_dim <= cpu_paged.MAX_DIM
            and model.shard.num_heads // model.shard.num_kv_heads <= cpu_paged.MAX_GROUP
        )
        if not plain:  # experts and the like: no dense MLP to read the linears of
            return None
        found = model.projections()
        if len(found) != len(SITES) * len(model.layers):  # a layer without a dense MLP
            return None
        sites = [found[i, site] for i in range(len(model.layers)) for site in SITES]
        linears = [p.linear for p in sites]
        if not all(_qualifies(lin) for lin in linears):
            return None
        isa = linears[0].isa
        if not cpu_layer.available(isa) or model.norm.weight.dtype != torch.float32:
            return None
        shape = cpu_layer.Shape(
            cfg.hidden_size,
            model.shard.num_heads,
            model.shard.num_kv_heads,
            model.head_dim,
            model.mlp_range[1] - model.mlp_range[0],
            model.layers[0].input_layernorm.eps,
        )
        return cls(model, sites, shape, isa)

    def run(
        self, x: torch.Tensor, batch: ForwardBatch, attn: Any, cos_sin: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer over the step's embeddings x [T, H]: (the last MLP output, the stream),
        or None where this step does not qualify."""
        meta = _decode_only(batch, attn)
        if meta is None or x.dtype != torch.float32:
            return None
        pool, linears = attn.kv_pool, [p.linear for p in self.sites]
        held = [pool.k_buffers[0], *(getattr(lin, "weight", lin) for lin in linears)]
        if self._layers is None or any(a is not b for a, b in zip(held, self._held, strict=True)):
            if not all(_qualifies(lin) for lin in linears):  # a weight update changed their kind
                return None
            self._layers, self._held = self._records(pool), held
        residual = torch.zeros_like(x)  # the first norm adds x to it: the stream is x
        x = x.contiguous().clone()
        cos, sin = cos_sin
        cpu_layer.decode_layers(
            self._layers,
            self.shape,
            x,
            residual,
            cos[:, 0],
            sin[:, 0],
            batch.out_slots,
            meta.decode_slots,
            meta.decode_lens,
            self.isa,
        )
        return x, residual

    def _records(self, pool: Any) -> ctypes.Array[cpu_layer.Layer]:
        n = len(SITES)
        records = [
            cpu_layer.layer_of(
                (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data),
                tuple(p.linear.weight for p in self.sites[i * n : (i + 1) * n]),
                pool.k_buffers[i],
                pool.v_buffers[i],
            )
            for i, layer in enumerate(self.model.layers)
        ]
        layers: ctypes.Array[cpu_layer.Layer] = (cpu_layer.Layer * len(records))(*records)
        return layers


def _qualifies(linear: Any) -> bool:
    grouped = type(linear) is GroupedLinear and linear.perm is None
    return (
        (grouped or type(linear) is Int8Linear)
        and linear.bias is None
        and linear.isa not in (Isa.TORCH, None)  # the C kernels' (None: a GPU's Triton GEMM)
    )


def _decode_only(batch: ForwardBatch, attn: Any) -> TorchMetadata | None:
    """The step's decode layout where every row is a decode row over its own keys in a float32
    pool read in place, else None."""
    if not isinstance(attn, TorchAttentionBackend) or not attn.in_place or attn.kv_pool.fmt:
        return None
    meta: TorchMetadata | None = (
        batch.attn_metadata.get(None) if isinstance(batch.attn_metadata, dict) else None
    )
    if meta is None or meta.extends or meta.shared_slots is not None:
        return None
    if attn.deterministic or len(meta.decode_tokens) != len(batch.out_slots):
        return None
    return meta
