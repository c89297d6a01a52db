"""The layers every family composes: RMSNorm, rotary tables, attention over this rank's heads
through the attention backend, the gated MLP (dense, or the experts of `moe.py`), the vocabulary's
embedding (float or packed), the attention decoder's layer, and the mixers a layer may hold in
attention's place, each carrying a state per request (LFM2's short convolution, the Gated
DeltaNet of Qwen3.5 and Qwen3-Next, Mamba-2's state space of Bamba). A family's module
(`llama.py`, `qwen.py`, ...) builds its model from these; what it swaps in is its `Family`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixrt import kernels
from radixrt.attention import AttentionBackend
from radixrt.distributed.group import TPGroup
from radixrt.distributed.sharding import HeadShard, split_range
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_fused
from radixrt.kernels.int4_gemm import PackedGroups
from radixrt.models.family import Family, MoeSpec
from radixrt.models.moe import GatedMLP, SparseMoE, gated


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
    """cos/sin tables for every position, using transformers' own rope-scaling formulas, over
    the first `partial_rotary_factor` of each head (Phi-4's 0.75; the rest passes through).
    longrope's table is its short factors: exact while the context stays within
    `original_max_position_embeddings` (support.py caps it there). With `layer_type`, the
    table of that type's own parameters (Gemma 3's local and global theta). Without `rotary`
    (a model without positions: Granite 4's "nope"), tables over none of each head's dims, which
    `apply_rotary` passes whole. The tables are float32 on the CPU when built (moved with the
    model, never cast) and cast per use."""

    cos: torch.Tensor  # [max_positions, rotated dims], a buffer
    sin: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
        rotary: bool = True,
    ):
        super().__init__()
        # computed, never loaded: real tables even while the model is built on the meta device
        with torch.device("cpu"):
            rope = getattr(config, "rope_parameters", None) or {
                "rope_type": "default",
                "rope_theta": getattr(config, "rope_theta", 10000.0),
            }
            if layer_type is not None:
                rope = rope[layer_type]
            rope_type = rope.get("rope_type", "default")
            if not rotary:
                inv_freq, scaling = torch.empty(0), 1.0
            elif rope_type == "default":
                factor = rope.get(
                    "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1)
                )
                dim = int(head_dim * factor)
                inv_freq = 1.0 / (
                    rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
                )
                scaling = 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
                    config, torch.device("cpu"), layer_type=layer_type
                )
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
    """Rotate the first `cos.shape[-1]` dims of each head of `x` [T, H, D]; the rest pass."""
    cos, sin = cos_sin
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = torch.split(x, [cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    """This rank's attention heads (`shard`): a column-parallel fused qkv projection, the
    family's per-head q/k RMSNorms if it has them (or its key factor, `key_scale`), a
    row-parallel output projection, and one all-reduce of its output."""

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        layer_id: int,
        head_dim: int,
        shard: HeadShard,
        tp: TPGroup,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.gated = family.attn_output_gate  # q_proj's rows: each head's query, then its gate
        self.q_rows = 2 * self.q_size if self.gated else self.q_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_rows + 2 * self.kv_size, bias=family.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, family.norm_eps)
            self.k_norm = RMSNorm(head_dim, family.norm_eps)
        self.query_scale, self.key_scale = family.query_scale, family.key_scale

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        whole_heads_rotated = cos_sin[0].shape[-1] == self.head_dim
        plain = not self.qk_norm and not self.gated and self.key_scale == 1.0
        if cpu_fused.supports(qkv) and whole_heads_rotated and plain:
            # q rotated; k rotated and v stored in the pool
            cos, sin = cos_sin
            if attn.kv_pool.fmt is None:
                k_buf = attn.kv_pool.k_buffers[self.layer_id]
                v_buf = attn.kv_pool.v_buffers[self.layer_id]
                q = cpu_fused.rope_and_store(
                    qkv, cos[:, 0], sin[:, 0], self.num_heads, k_buf, v_buf, batch.out_slots
                )
            else:  # rotated into rows of their own, then quantized into the pool
                q, k, v = self._rope_rows(qkv, cos[:, 0], sin[:, 0])
                attn.kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
            if self.query_scale != 1.0:
                q = q * self.query_scale
            out = self.o_proj(
                attn.forward(self.layer_id, q, None, None, batch).view(-1, self.q_size)
            )
            return self.tp.all_reduce(out)
        q, k, v = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(-1, self.q_size)
        if self.qk_norm:  # over each head's D values: rows of [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        if self.key_scale != 1.0:
            k = k * self.key_scale
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos_sin)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos_sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        attn.kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
        o = attn.forward(self.layer_id, q, k, v, batch).reshape(-1, self.q_size)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(o))

    def _rope_rows(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused rotary kernel into fresh rows: q, k rotated and v [T, heads, D] each."""
        t = qkv.shape[0]
        k = qkv.new_empty(t, self.num_kv_heads, self.head_dim)
        v = torch.empty_like(k)
        rows = torch.arange(t, dtype=torch.int64)
        q = cpu_fused.rope_and_store(qkv, cos, sin, self.num_heads, k, v, rows)
        return q, k, v


class MLP(GatedMLP):
    """This rank's slice of the intermediate size: column-parallel gate/up, row-parallel down,
    one all-reduce of its output. `scales` (the family's `mlp_scales`): the gate's output is
    multiplied by the first before the activation, down's output by the second."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        tp: TPGroup,
        activation: str,
        scales: tuple[float, float] = (1.0, 1.0),
    ):
        super().__init__(hidden, intermediate, activation)
        self.tp, self.scales = tp, scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales == (1.0, 1.0):
            return self.tp.all_reduce(super().forward(x))
        gate, down = self.scales
        gate_up = self.gate_up_proj(x)
        gate_up[..., : gate_up.shape[-1] // 2] *= gate
        out = self.down_proj(gated(gate_up, self.activation)) * down
        return self.tp.all_reduce(out)


class VocabSlice(nn.Module):
    """This rank's rows [start, end) of the embedding table: ids outside them look up zeros, and
    an all-reduce sums the ranks' parts into every id's row. `rows` reads this rank's table."""

    def __init__(self, vocab: tuple[int, int], tp: TPGroup):
        super().__init__()
        self.start, self.end = vocab
        self.tp = tp

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (local: in [0, end - start)) of this rank's table."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.rows(ids)
        outside = (ids < self.start) | (ids >= self.end)
        x = self.rows((ids - self.start).masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class VocabParallelEmbedding(VocabSlice):
    """The table as a float parameter (`weight`, the model's dtype)."""

    def __init__(self, vocab: tuple[int, int], hidden: int, tp: TPGroup):
        super().__init__(vocab, tp)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class PackedEmbedding(VocabSlice):
    """The table kept in groups of 32 (`int4_gemm.PackedGroups`: a GGUF file's blocks as stored,
    or 8-bit groups rounded as the float table streamed in), each row dequantized as it is looked
    up: the same float32 values `dequantize` gives, in the model's `dtype` (a GPU's bfloat16),
    and no float copy of the table. A tied output projection multiplies by the same groups
    (`LlamaForCausalLM.keep_embedding_packed`)."""

    def __init__(
        self, weight: PackedGroups, vocab: tuple[int, int], tp: TPGroup, dtype: torch.dtype
    ):
        super().__init__(vocab, tp)
        assert weight.out_features == self.end - self.start
        self.weight = weight
        self.dtype = dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.weight.rows(ids)
        return rows.to(self.dtype)


class DecoderLayer(nn.Module):
    """Norm, the layer's mixer (attention, or a family's other kind: `mixer_name` says under
    which name its checkpoint and the model keep it), norm, and the dense MLP (`mlp` wide on
    this rank) or, on the family's sparse layers, the experts (`expert_mlp` wide each); with
    sandwich norms (Gemma) the mixer's and the MLP's outputs are normed too before they join the
    stream, else scaled by the family's `residual_scale` (Granite 4). A mixer is called as
    attention is: (x, batch, cos_sin, attn)."""

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        layer_id: int,
        mixer: tuple[str, nn.Module],
        widths: tuple[int, int],
        expert_ids: tuple[int, int],
        tp: TPGroup,
    ):
        super().__init__()
        mlp, expert_mlp = widths
        self.input_layernorm = RMSNorm(config.hidden_size, family.norm_eps)
        self.mixer_name = mixer[0]
        self.add_module(*mixer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, family.norm_eps)
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, family.norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, family.norm_eps)
        self.residual_scale = family.residual_scale
        moe = family.moe
        self.mlp = (
            SparseMoE(config.hidden_size, moe, expert_mlp, tp, family.activation, expert_ids)
            if moe is not None and layer_id in moe.sparse_layers
            else MLP(config.hidden_size, mlp, tp, family.activation, family.mlp_scales)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): the next norm adds
        it, so each add fuses with a norm. The sums are HF's: stream + mixer, then + MLP."""
        h, residual = self.input_layernorm(x, residual)
        h = self._modules[self.mixer_name](h, batch, cos_sin, attn)  # type: ignore[misc]
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(
                self.post_attention_layernorm(h)[0], residual
            )
            return self.post_feedforward_layernorm(self.mlp(h))[0], residual
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        h, residual = self.post_attention_layernorm(h, residual)
        out: torch.Tensor = self.mlp(h)
        if self.residual_scale != 1.0:
            out = out * self.residual_scale
        return out, residual


class StatefulMixer(nn.Module):
    """A mixer that carries a state per request besides (or instead of) KV: a row of each of
    its state buffers per state slot (`allocate_state`), a batch naming each request's slot
    (`ForwardBatch.state_slots`); a request whose step starts at position 0 starts from zeros.
    Served on one rank."""

    def allocate_state(self, slots: int, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
        """Zeroed state buffers of `slots` rows on the model's device, a recurrence's in
        `ssm_dtype` (`--mamba-ssm-dtype`), a convolution's in the model's dtype; returns them
        (a slot's state is row `slot` of each: what is copied, snapshotted and stored)."""
        raise NotImplementedError


class ConvRecurrence(StatefulMixer):
    """A mixer whose state per request is a depthwise causal convolution's last inputs
    (`conv_state` [slots, channels, taps - 1], the model's dtype, the taps from `conv_weight`
    [channels, 1, taps]) and a recurrence's state (`state` [slots, *`state_shape`], kept in
    `--mamba-ssm-dtype`): the Gated DeltaNet's, Mamba-2's."""

    conv_weight: nn.Parameter
    state_shape: tuple[int, ...]
    conv_state: torch.Tensor | None = None
    state: torch.Tensor | None = None

    def allocate_state(self, slots: int, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
        w = self.conv_weight
        self.conv_state = w.new_zeros(slots, w.shape[0], w.shape[-1] - 1)
        self.state = w.new_zeros(slots, *self.state_shape, dtype=ssm_dtype)
        return [self.conv_state, self.state]

    def recur(
        self,
        batch: ForwardBatch,
        rows: tuple[torch.Tensor, ...],
        out: torch.Tensor,
        step: Callable[..., torch.Tensor],
        chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        chunk_len: int,
    ) -> torch.Tensor:
        """The recurrence on the CPU over the batch's per-token `rows` (each [T, ...]), into
        `out` [T, ...] (float32): decode rows all at once (`step(s, *rows)` on their states
        gathered from their slots, zeros for a fresh one, [R, ...] updated in place, then
        scattered back), or each request's tokens `chunk_len` at a time (`chunk(s, *rows of
        the chunk)` -> its output and the state after it)."""
        assert self.state is not None and batch.state_slots is not None
        if all(e == 1 for e in batch.extend_lens):
            slots = batch.state_slots
            fresh = torch.tensor([p == 0 for p in batch.prefix_lens], device=out.device)
            s = self.state.index_select(0, slots).float()
            s.masked_fill_(fresh.view(-1, *[1] * (s.dim() - 1)), 0.0)
            out = step(s, *rows)
            self.state.index_copy_(0, slots, s.to(self.state.dtype))
            return out
        start = 0
        for slot, prefix, n in zip(
            batch.state_slots.tolist(), batch.prefix_lens, batch.extend_lens
        ):
            s = self.state[slot].float() if prefix else out.new_zeros(self.state.shape[1:])
            for lo in range(start, start + n, chunk_len):
                hi = min(lo + chunk_len, start + n)
                out[lo:hi], s = chunk(s, *(r[lo:hi] for r in rows))
            self.state[slot] = s
            start += n
        return out


MAX_TAPS = 64  # a causal convolution's most taps (its state per request: taps - 1 inputs)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """A depthwise causal convolution of x [T, C] (each request's rows after its past inputs,
    `state`: [slots, C, taps - 1] of the last ones, updated in place) by `weight` [C, 1, taps]:
    [T, C]. Decode rows in one call; a request's several new rows in one call of their own."""
    assert batch.state_slots is not None, "a recurrent model's batch names its state slots"
    if x.is_cuda:  # Triton: the whole batch's decode rows and prefill runs in one launch
        runs = (batch.state_slots, batch.prefix_lens, batch.extend_lens)
        out: torch.Tensor = kernels.causal_conv_fwd(x, weight, bias, state, *runs)
        return out
    channels, keep = x.shape[1], weight.shape[-1] - 1
    if all(e == 1 for e in batch.extend_lens):
        slots = batch.state_slots
        past = state.index_select(0, slots)
        fresh = torch.tensor([p == 0 for p in batch.prefix_lens], device=x.device)
        past.masked_fill_(fresh[:, None, None], 0.0)
        window = torch.cat([past, x[:, :, None]], dim=-1)  # [B, C, taps]
        state.index_copy_(0, slots, window[:, :, 1:])
        return F.conv1d(window, weight, bias, groups=channels)[:, :, 0]
    parts, start = [], 0
    for slot, prefix, n in zip(batch.state_slots.tolist(), batch.prefix_lens, batch.extend_lens):
        past = state[slot] if prefix else state.new_zeros(channels, keep)
        window = torch.cat([past, x[start : start + n].T], dim=-1)[None]
        parts.append(F.conv1d(window, weight, bias, groups=channels)[0].T)
        state[slot] = window[0, :, -keep:]
        start += n
    return torch.cat(parts)


class ShortConv(StatefulMixer):
    """LFM2's gated short convolution: B, C and x from one projection, a depthwise causal
    convolution of `kernel` taps over B * x, times C, and the output projection. Its state is
    the convolution's last `kernel - 1` inputs."""

    state: torch.Tensor | None

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.weight = nn.Parameter(torch.empty(hidden, 1, kernel))
        self.bias = nn.Parameter(torch.empty(hidden)) if bias else None
        self.state = None

    def allocate_state(self, slots: int, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
        self.state = self.weight.new_zeros(slots, self.hidden, self.kernel - 1)
        return [self.state]

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        assert self.state is not None, "the model's states were never allocated"
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        out = causal_conv(b * v, self.weight, self.bias, self.state, batch)
        y: torch.Tensor = self.out_proj(c * out)
        return y


class GatedDeltaNet(ConvRecurrence):
    """Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next: q, k and v from one
    projection through a depthwise causal convolution (`kernel` taps) and SiLU; q and k
    L2-normed per head (q scaled by 1/sqrt(key_dim)), each of `k_heads` shared by
    `v_heads / k_heads` value heads; per token and value head a decay exp(g), g = -exp(A_log) *
    softplus(a + dt_bias), and a write strength beta = sigmoid(b). The state S [key_dim,
    value_dim] per head is decayed, corrected towards v along k (the delta rule: S += k (beta (v -
    S^T k))^T), and read by q; the output is RMS-normed per head (`norm_weight`, eps), times
    SiLU(z), and projected out. Its state per request: the convolution's last inputs and S (kept
    in `--mamba-ssm-dtype`, computed in float32): decode rows a token each, together; a
    prefill's tokens a chunk at a time (`delta_chunk`). The value heads are grouped by the key
    head they share (value head h reads key head h // (v_heads / k_heads)), or, `tiled`, in
    llama.cpp's GGUF order (h reads key head h mod k_heads)."""

    def __init__(
        self,
        hidden: int,
        heads: tuple[int, int],
        dims: tuple[int, int],
        kernel: int,
        eps: float,
        tiled: bool = False,
    ):
        super().__init__()
        (self.k_heads, self.v_heads), (self.k_dim, self.v_dim) = heads, dims
        self.tiled = tiled
        self.key_width, self.value_width = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_width = 2 * self.key_width + self.value_width
        self.kernel, self.eps = kernel, eps
        self.in_proj_qkv = nn.Linear(hidden, self.conv_width, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_width, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_width, 1, kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm_weight = nn.Parameter(torch.empty(self.v_dim))
        self.out_proj = nn.Linear(self.value_width, hidden, bias=False)
        self.state_shape = (self.v_heads, self.k_dim, self.v_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        assert (
            self.conv_state is not None and self.state is not None and batch.state_slots is not None
        )
        t = x.shape[0]
        mixed = F.silu(
            causal_conv(self.in_proj_qkv(x), self.conv_weight, None, self.conv_state, batch)
        )
        q, k, v = torch.split(mixed.float(), [self.key_width, self.key_width, self.value_width], -1)
        q, k = (y.reshape(t, self.k_heads, self.k_dim) for y in (q, k))
        if self.v_heads != self.k_heads:
            per = self.v_heads // self.k_heads
            q, k = (
                y.repeat(1, per, 1) if self.tiled else y.repeat_interleave(per, 1) for y in (q, k)
            )
        q = _l2norm(q) * self.k_dim**-0.5
        k = _l2norm(k)
        v = v.reshape(t, self.v_heads, self.v_dim)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty_like(v)
        if x.is_cuda:  # Triton: every request's tokens, decode rows and prefill runs, in one launch
            runs = (batch.state_slots, batch.prefix_lens, batch.extend_lens)
            kernels.gated_delta_fwd(q, k, v, g, beta, out, self.state, *runs)
        else:
            out = self.recur(batch, (q, k, v, g, beta), out, self._step, delta_chunk, DELTA_CHUNK)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (
            self.norm_weight
            * normed
            * F.silu(self.in_proj_z(x).float().reshape(t, self.v_heads, self.v_dim))
        )
        y: torch.Tensor = self.out_proj(gated.reshape(t, self.value_width).to(x.dtype))
        return y

    @staticmethod
    def _step(
        s: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of B requests: states s [B, H, Dk, Dv] updated in place; the
        output [B, H, Dv]."""
        s.mul_(g.exp()[:, :, None, None])
        remembered = (k[:, :, None, :] @ s)[:, :, 0]  # S^T k: [B, H, Dv]
        delta = (v - remembered) * beta[:, :, None]
        s.add_(k[:, :, :, None] * delta[:, :, None, :])
        return (q[:, :, None, :] @ s)[:, :, 0]


DELTA_CHUNK = 64  # tokens of a prefill the gated delta rule takes in one chunk


def delta_chunk(
    s0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens of one request through the gated delta rule at once, from state s0 [H, Dk, Dv]:
    (outputs [C, H, Dv], the state after). The recurrence S_t = a_t (I - b_t k_t k_t^T) S_{t-1}
    + b_t k_t v_t^T (a_t = exp(g_t)) unrolls, with G_t = g_1 + ... + g_t, to S_t = exp(G_t) S0 +
    sum_{i<=t} exp(G_t - G_i) k_i w_i^T, where the corrections w solve the unit lower-triangular
    system w_i + b_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) w_j = b_i (v_i - exp(G_i) S0^T k_i);
    then o_t = S_t^T q_t. Matrix products over the chunk in place of C steps."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, C, D]
    g, beta = g.T, beta.T  # [H, C]
    cum = g.cumsum(-1)
    c = cum.shape[-1]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    system = (k @ k.transpose(-1, -2)) * decay * beta[:, :, None] * (1 - eye) + eye
    grown = cum.exp()[:, :, None]
    rhs = torch.cat([beta[:, :, None] * v, beta[:, :, None] * grown * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ s0  # [H, C, Dv]
    out = grown * (q @ s0) + ((q @ k.transpose(-1, -2)) * decay) @ w
    tail = (cum[:, -1:] - cum).exp()[:, :, None]  # exp(G_C - G_i)
    s = cum[:, -1].exp()[:, None, None] * s0 + (k * tail).transpose(-1, -2) @ w
    return out.transpose(0, 1), s


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x over its last dimension, as flash-linear-attention's l2norm (eps 1e-6 inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def expert_shard(moe: MoeSpec | None, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's (slice of each expert's intermediate dimension, range of experts held): under
    TP every expert's slice, under EP (`tp.expert_parallel`) a share of the experts, whole."""
    if moe is None:
        return (0, 0), (0, 0)
    if tp.expert_parallel:
        return (0, moe.intermediate_size), split_range(moe.num_experts, tp.size, tp.rank)
    return split_range(moe.intermediate_size, tp.size, tp.rank), (0, moe.num_experts)


class Mamba2Mixer(ConvRecurrence):
    """Mamba-2's selective state-space mixer (Bamba's, as Granite 4's hybrid layers). One projection
    gives the gate z, the convolved channels xBC and a time step per head; xBC goes through a
    depthwise causal convolution (`kernel` taps, with its bias where the checkpoint has one) and
    SiLU, then splits into x (`heads` heads of `head_dim`), B and C (`groups` groups of `state`
    values, each group shared by heads / groups heads). Per token and head h:
    dt = clamp(softplus(dt_raw + dt_bias), *dt_limit), a = -exp(A_log), and the state
    S [head_dim, state] follows S <- exp(dt a) S + dt x B^T, read as y = S C + D x. The heads'
    outputs, times SiLU(z), are RMS-normed per group (`norm_weight`, eps) and projected out
    (`gate_norm` "after_gate"); or normed first and then gated ("before_gate"), or gated and
    not normed at all (None: no `norm_weight`), as Falcon-H1's `mamba_norm_before_gate` and
    `mamba_rms_norm` say. `proj_scales` multiply the projection's z, x, B, C and dt parts
    (Falcon-H1's `ssm_multipliers`, transformers' mup vector), before anything reads them.
    Its state per request: the convolution's last `kernel - 1` inputs (the model's dtype) and S
    (`--mamba-ssm-dtype`, computed in float32): decode rows a token each, all together; a
    prefill's tokens `chunk` at a time in the SSD form (`ssd_chunk`)."""

    conv_state: torch.Tensor | None
    state: torch.Tensor | None
    proj_scale: torch.Tensor | None  # `proj_scales` by column of the projection, a buffer

    GATE_NORMS = ("after_gate", "before_gate", None)

    def __init__(
        self,
        hidden: int,
        heads: tuple[int, int, int],
        state: int,
        kernel: int,
        chunk: int,
        biases: tuple[bool, bool],
        eps: float,
        dt_limit: tuple[float, float],
        *,
        out_bias: bool | None = None,
        gate_norm: str | None = "after_gate",
        proj_scales: tuple[float, float, float, float, float] = (1.0,) * 5,
    ):
        """`heads`: (heads, head_dim, groups); `biases`: (the in projection's, the
        convolution's); `out_bias`: the out projection's where it differs from the in
        projection's (Falcon-H1's `projectors_bias`); `gate_norm`: one of `GATE_NORMS`."""
        super().__init__()
        assert gate_norm in self.GATE_NORMS
        (self.heads, self.head_dim, self.groups), self.state_size = heads, state
        self.inner = self.heads * self.head_dim
        self.conv_width = self.inner + 2 * self.groups * state
        self.kernel, self.chunk, self.eps, self.dt_limit = kernel, chunk, eps, dt_limit
        proj_bias, conv_bias = biases
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_width + self.heads, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_width, 1, kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_width)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.gate_norm = gate_norm
        if gate_norm is not None:
            self.norm_weight = nn.Parameter(torch.empty(self.inner))
        self.out_proj = nn.Linear(
            self.inner, hidden, bias=proj_bias if out_bias is None else out_bias
        )
        scale = None
        if any(f != 1.0 for f in proj_scales):  # computed, never loaded: real even on meta
            bc = self.groups * state
            widths = (self.inner, self.inner, bc, bc, self.heads)
            with torch.device("cpu"):
                scale = torch.cat([torch.full((w,), f) for w, f in zip(widths, proj_scales)])
        self.register_buffer("proj_scale", scale, persistent=False)
        self.state_shape = (self.heads, self.head_dim, self.state_size)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        assert (
            self.conv_state is not None and self.state is not None and batch.state_slots is not None
        )
        t, width = x.shape[0], self.groups * self.state_size
        projected = self.in_proj(x)
        if self.proj_scale is not None:
            projected = projected * self.proj_scale.to(projected.dtype)
        z, xbc, dt = projected.split([self.inner, self.conv_width, self.heads], dim=-1)
        xbc = F.silu(causal_conv(xbc, self.conv_weight, self.conv_bias, self.conv_state, batch))
        xs, b, c = torch.split(xbc.float(), [self.inner, width, width], dim=-1)
        xs = xs.reshape(t, self.heads, self.head_dim)
        b, c = (
            y.reshape(t, self.groups, self.state_size).repeat_interleave(
                self.heads // self.groups, dim=1
            )
            for y in (b, c)
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        a = -self.A_log.float().exp()
        out = torch.empty_like(xs)
        if x.is_cuda:  # Triton: the whole batch's decode rows and prefill runs in one launch
            runs = (batch.state_slots, batch.prefix_lens, batch.extend_lens)
            kernels.ssd_fwd(xs, dt, a, b, c, out, self.state, *runs)
        else:
            out = self.recur(
                batch,
                (xs, dt, b, c),
                out,
                lambda s, xs, dt, b, c: self._step(s, xs, dt, a, b, c),
                lambda s, xs, dt, b, c: ssd_chunk(s, xs, dt, a, b, c),
                self.chunk,
            )
        out = (out + self.D.float()[:, None] * xs).reshape(t, -1)
        gate = F.silu(z.float())
        if self.gate_norm == "after_gate":
            mixed = self.norm_weight * self._group_norm(out * gate).to(x.dtype)
        elif self.gate_norm == "before_gate":
            mixed = (self.norm_weight * self._group_norm(out) * gate).to(x.dtype)
        else:
            mixed = (out * gate).to(x.dtype)
        y: torch.Tensor = self.out_proj(mixed)
        return y

    def _group_norm(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, inner] RMS-normed over each group's channels (no weight)."""
        grouped = y.reshape(y.shape[0], self.groups, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.reshape(y.shape)

    @staticmethod
    def _step(
        s: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of R requests (x [R, H, P], dt [R, H], b and c [R, H, N], a [H]):
        states s [R, H, P, N] updated in place; S C [R, H, P] (without D x)."""
        s.mul_((dt * a).exp()[:, :, None, None])
        s.add_((dt[:, :, None, None] * b[:, :, None, :]) * x[:, :, :, None])
        return (s @ c[:, :, :, None])[..., 0]


def ssd_chunk(
    s0: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one request through Mamba-2's recurrence at once (state space duality), from
    state s0 [H, P, N]: (S C per token [L, H, P], without D x; the state after). With
    l_t = dt_t a the log decays and G_t = l_1 + ... + l_t, the recurrence S_t = exp(l_t) S_{t-1}
    + dt_t x_t B_t^T unrolls to S_t = exp(G_t) S0 + sum_{i<=t} exp(G_t - G_i) dt_i x_i B_i^T, so
    y_t = S_t C_t = exp(G_t) S0 C_t + sum_{i<=t} (C_t . B_i) exp(G_t - G_i) dt_i x_i: matrix
    products over the chunk in place of L steps. The decays exp(G_t - G_i) are sums of the l in
    (i, t], summed as such (not a difference of two running sums, which loses the small ones)."""
    xdt = (x * dt[:, :, None]).transpose(0, 1)  # [H, L, P]
    b, c = b.transpose(0, 1), c.transpose(0, 1)  # [H, L, N]
    logs = (dt * a).T  # [H, L]
    n = logs.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    strictly = logs[:, :, None].expand(-1, n, n).masked_fill(~lower.tril(-1), 0.0)
    segments = strictly.cumsum(1).masked_fill(~lower, float("-inf"))  # [H, t, i]: G_t - G_i
    grown = logs.cumsum(-1)  # G_t
    out = ((c @ b.transpose(-1, -2)) * segments.exp()) @ xdt
    out = out + grown.exp()[:, :, None] * (c @ s0.transpose(-1, -2))
    tail = segments[:, -1, :].exp()[:, :, None]  # exp(G_L - G_i)
    s = grown[:, -1].exp()[:, None, None] * s0 + (xdt * tail).transpose(-1, -2) @ b
    return out.transpose(0, 1), s
