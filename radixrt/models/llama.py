"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a flattened ragged batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixrt.attention import AttentionBackend
from radixrt.kernels import cpu_fused

if TYPE_CHECKING:  # types only: the executor and the pools import this package, not the reverse
    from radixrt.executor.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm, residual stream): without `residual`, `x` is the stream; with it, `x` is added
        to it first (in place on the CPU's fused path) and the sum is the stream."""
        if cpu_fused.supports(x):
            out = cpu_fused.rms_norm(x, self.weight, self.eps, residual)
            return out, x if residual is None else residual
        if residual is not None:
            x = residual + x
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, using transformers' own rope-scaling formulas."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(config, "rope_theta", 10000.0),
        }
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            inv_freq = 1.0 / (
                rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
            )
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, 1, head_dim]` at `positions`, looked up once per forward for every layer."""
        return (
            self.cos.index_select(0, positions).to(dtype)[:, None, :],
            self.sin.index_select(0, positions).to(dtype)[:, None, :],
        )


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_id: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if cpu_fused.supports(qkv):  # q rotated; k rotated and v stored in the pool
            k_buf, v_buf = (
                attn.kv_pool.k_buffers[self.layer_id],
                attn.kv_pool.v_buffers[self.layer_id],
            )
            cos, sin = cos_sin
            q = cpu_fused.rope_and_store(
                qkv, cos[:, 0], sin[:, 0], self.num_heads, k_buf, v_buf, batch.out_slots
            )
            return self.o_proj(
                attn.forward(self.layer_id, q, None, None, batch).view(-1, self.q_size)
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos_sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos_sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        attn.kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
        o = attn.forward(self.layer_id, q, k, v, batch)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_fused.supports(gate_up):
            return self.down_proj(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, head_dim: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, head_dim)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): the next norm adds
        it, so each add fuses with a norm. The sums are HF's: stream + attention, then + MLP."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(
            self.self_attn(h, batch, cos_sin, attn), residual
        )
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.head_dim = head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, head_dim) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, head_dim, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, one row per new token."""
        x, residual = self.embed_tokens(batch.input_ids), None
        cos_sin = self.rope(batch.positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, batch, cos_sin, attn)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names, fusing q/k/v and gate/up projections."""
        own = dict(self.named_parameters())
        loaded = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            own[name].data.copy_(tensor)
            loaded.add(name)

        for i in range(self.config.num_hidden_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
                if parts[0] in state:
                    put(me + f"self_attn.qkv_proj.{kind}", torch.cat([state.pop(p) for p in parts]))
            put(
                me + "mlp.gate_up_proj.weight",
                torch.cat(
                    [state.pop(hf + "mlp.gate_proj.weight"), state.pop(hf + "mlp.up_proj.weight")]
                ),
            )
        for name, tensor in state.items():
            target = name.removeprefix("model.")
            if target in own:
                put(target, tensor)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")
