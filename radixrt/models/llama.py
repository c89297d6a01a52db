"""The decoder skeleton every served family shares (Llama, Mistral, Qwen2, SmolLM, Qwen3,
Phi-3/4, Mixtral, Qwen3-MoE, Gemma 2/3) over a flattened ragged batch; a `Family` (family.py)
names the parts a family swaps in: norms, biases, a sparse MLP, fused checkpoint tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixrt.attention import AttentionBackend
from radixrt.distributed.group import TPGroup
from radixrt.distributed.sharding import HeadShard, shard_heads, split_range
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_fused
from radixrt.kernels.int4_gemm import PackedGroups
from radixrt.models.family import Family, MoeSpec, family_of, rope_per_layer_type
from radixrt.models.fused_decode import FusedDecode
from radixrt.models.interface import CausalLM, WeightSource
from radixrt.models.moe import GatedMLP, SparseMoE


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
    table of that type's own parameters (Gemma 3's local and global theta). The tables are
    float32 on the CPU when built (moved with the model, never cast) and cast per use."""

    cos: torch.Tensor  # [max_positions, rotated dims], a buffer
    sin: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
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
            if rope_type == "default":
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
    family's per-head q/k RMSNorms if it has them, a row-parallel output projection, and one
    all-reduce of its output."""

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
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=family.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.query_scale = family.query_scale

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        whole_heads_rotated = cos_sin[0].shape[-1] == self.head_dim
        if cpu_fused.supports(qkv) and whole_heads_rotated and not self.qk_norm:
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
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # over each head's D values: rows of [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos_sin)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos_sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        attn.kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
        o = attn.forward(self.layer_id, q, k, v, batch)
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))

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
    one all-reduce of its output."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, activation: str):
        super().__init__(hidden, intermediate, activation)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


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
    """Norm, attention, norm, and the dense MLP (`mlp` wide on this rank) or, on the family's
    sparse layers, the experts (`expert_mlp` wide each); with sandwich norms (Gemma) the
    attention's and the MLP's outputs are normed too before they join the stream."""

    def __init__(
        self,
        config: PretrainedConfig,
        family: Family,
        layer_id: int,
        head_dim: int,
        shard: HeadShard,
        widths: tuple[int, int],
        expert_ids: tuple[int, int],
        tp: TPGroup,
    ):
        super().__init__()
        mlp, expert_mlp = widths
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, family, layer_id, head_dim, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = family.moe
        self.mlp = (
            SparseMoE(config.hidden_size, moe, expert_mlp, tp, family.activation, expert_ids)
            if moe is not None and layer_id in moe.sparse_layers
            else MLP(config.hidden_size, mlp, tp, family.activation)
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
        it, so each add fuses with a norm. The sums are HF's: stream + attention, then + MLP."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch, cos_sin, attn)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(
                self.post_attention_layernorm(h)[0], residual
            )
            return self.post_feedforward_layernorm(self.mlp(h))[0], residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def expert_shard(moe: MoeSpec | None, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's (slice of each expert's intermediate dimension, range of experts held): under
    TP every expert's slice, under EP (`tp.expert_parallel`) a share of the experts, whole."""
    if moe is None:
        return (0, 0), (0, 0)
    if tp.expert_parallel:
        return (0, moe.intermediate_size), split_range(moe.num_experts, tp.size, tp.rank)
    return split_range(moe.intermediate_size, tp.size, tp.rank), (0, moe.num_experts)


class LlamaForCausalLM(CausalLM):
    """The decoder, or with `tp` of size N one rank's shard of it: its heads (`shard`), its
    slice of the MLP (`mlp_range`), of each expert (`expert_range`) and of the vocabulary
    (`vocab_range`); norms, routers and rotary tables are whole on every rank.
    `compute_logits` gives this rank's vocabulary columns. `graph_safe` says whether a decode
    step may be captured as a CUDA graph (not with experts: their grouping reads counts)."""

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.family = family = family_of(config)
        self.graph_safe = family.moe is None
        self.tp = tp = tp or TPGroup()
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.head_dim = head_dim
        self.shard = shard_heads(
            config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank
        )
        self.mlp_range = split_range(config.intermediate_size, tp.size, tp.rank)
        self.expert_range, self.expert_ids = expert_shard(family.moe, tp)
        self.vocab_widths = [
            end - start
            for start, end in (split_range(config.vocab_size, tp.size, r) for r in range(tp.size))
        ]
        self.vocab_range = split_range(config.vocab_size, tp.size, tp.rank)
        widths = (
            self.mlp_range[1] - self.mlp_range[0],
            self.expert_range[1] - self.expert_range[0],
        )
        self.embed_tokens: VocabSlice = VocabParallelEmbedding(
            self.vocab_range, config.hidden_size, tp
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, family, i, head_dim, self.shard, widths, self.expert_ids, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # rotary tables by layer type ("all" where one serves every layer)
        self.rope_of_layer = family.rope_by_layer or ("all",) * config.num_hidden_layers
        self.rope = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    config, head_dim, max_positions, kind if rope_per_layer_type(config) else None
                )
                for kind in sorted(set(self.rope_of_layer))
            }
        )
        self.lm_head: nn.Module = nn.Linear(
            config.hidden_size, self.vocab_widths[tp.rank], bias=False
        )
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        self._fused: FusedDecode | None = None
        self._fused_checked = False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, one row per new token (the same on every rank)."""
        x, residual = self.embed_tokens(batch.input_ids), None
        if self.family.embed_scale != 1.0:
            x = x * torch.tensor(self.family.embed_scale, dtype=x.dtype)
        tables = {kind: rope(batch.positions, x.dtype) for kind, rope in self.rope.items()}
        fused = self._fused_decode()
        done = fused.run(x, batch, attn, tables["all"]) if fused else None
        if done is not None:  # every layer in one native call
            x, residual = done
        else:
            for layer, kind in zip(self.layers, self.rope_of_layer):
                x, residual = layer(x, residual, batch, tables[kind], attn)
        hidden: torch.Tensor = self.norm(x, residual)[0]
        return hidden

    def keep_embedding_packed(self, weight: PackedGroups, lm_head: nn.Module | None) -> None:
        """Look tokens up in `weight` (this rank's rows of the table, packed) from now on, and
        drop the float table; `lm_head`: the tied output projection's module over the same
        groups (None for an untied model, whose own output projection stays). Rows are looked up
        in the model's dtype (its final norm's: every parameter has it)."""
        assert (lm_head is not None) == self.tied
        vocab = (self.embed_tokens.start, self.embed_tokens.end)
        self.embed_tokens = PackedEmbedding(weight, vocab, self.tp, self.norm.weight.dtype)
        if lm_head is not None:
            self.lm_head = lm_head

    def _fused_decode(self) -> FusedDecode | None:
        """The one-call decode path (`fused_decode`), decided at the first step: the linears
        are packed by then."""
        if not self._fused_checked:
            self._fused, self._fused_checked = FusedDecode.of(self), True
        return self._fused

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary slice (soft-capped where the family caps them)."""
        cap = self.family.final_logit_softcap
        logits: torch.Tensor = self.lm_head(hidden)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, reader: WeightSource) -> None:
        """Load Hugging Face names into the parameters in place, reading only this rank's
        slices: q/k/v and gate/up fused (from separate tensors, or rows of Phi-3's fused ones),
        experts' as the dense MLP's. ValueError for a tensor missing or of the wrong shape."""
        own = dict(self.named_parameters())
        loaded = set()

        def param(name: str) -> torch.Tensor:
            """The parameter `name`'s storage, to fill (and counted as loaded)."""
            loaded.add(name)
            data: torch.Tensor = own[name].data
            return data

        q = (self.shard.q_start * self.head_dim, self.shard.q_end * self.head_dim)
        for i, layer in enumerate(self.layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                if me + f"self_attn.qkv_proj.{kind}" in own:
                    reader.stack_rows(param(me + f"self_attn.qkv_proj.{kind}"), self._qkv(hf, kind))
            reader.copy_cols(
                param(me + "self_attn.o_proj.weight"), hf + "self_attn.o_proj.weight", *q
            )
            norms = ["input_layernorm", "post_attention_layernorm"]
            if self.family.qk_norm:
                norms += ["self_attn.q_norm", "self_attn.k_norm"]
            if self.family.sandwich_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for norm in norms:
                param(me + f"{norm}.weight").copy_(self._norm(reader, hf + f"{norm}.weight"))
            if isinstance(layer.mlp, SparseMoE):
                self._load_experts(reader, hf, me, param)
            else:
                reader.stack_rows(param(me + "mlp.gate_up_proj.weight"), self._gate_up(hf + "mlp."))
                reader.copy_cols(
                    param(me + "mlp.down_proj.weight"),
                    hf + "mlp.down_proj.weight",
                    *self.mlp_range,
                )
        param("norm.weight").copy_(self._norm(reader, "model.norm.weight"))
        reader.copy_rows(
            param("embed_tokens.weight"), "model.embed_tokens.weight", *self.vocab_range
        )
        if not self.tied:
            reader.copy_rows(param("lm_head.weight"), "lm_head.weight", *self.vocab_range)
        missing = set(own) - loaded - ({"lm_head.weight"} if self.tied else set())
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")

    def _norm(self, reader: WeightSource, name: str) -> torch.Tensor:
        """An RMSNorm's weight as the norm multiplies by it: Gemma stores it less 1 (added in
        the stored dtype, as before any cast)."""
        return reader.whole(name) + self.family.norm_offset

    def _qkv(self, hf: str, kind: str) -> list[tuple[str, int, int]]:
        """This rank's rows of q, k and v, one after the other: (name, start, end) each."""
        s, hd, heads = self.shard, self.head_dim, self.config.num_attention_heads
        kv_heads = self.config.num_key_value_heads
        spans = [
            (s.q_start * hd, s.q_end * hd),
            (s.kv_start * hd, s.kv_end * hd),
            (s.kv_start * hd, s.kv_end * hd),
        ]
        if self.family.fused_checkpoint:  # rows of [q; k; v] in one tensor
            offsets = (0, heads * hd, (heads + kv_heads) * hd)
            name = hf + f"self_attn.qkv_proj.{kind}"
            return [(name, o + a, o + b) for o, (a, b) in zip(offsets, spans)]
        names = [hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
        return [(n, *span) for n, span in zip(names, spans)]

    def _gate_up(self, prefix: str) -> list[tuple[str, int, int]]:
        """This rank's rows of the dense MLP's gate, then of its up projection."""
        start, end = self.mlp_range
        if self.family.fused_checkpoint:  # rows of [gate; up] in one tensor
            width = self.config.intermediate_size
            name = prefix + "gate_up_proj.weight"
            return [(name, start, end), (name, width + start, width + end)]
        return [(prefix + f"{p}_proj.weight", start, end) for p in ("gate", "up")]

    def _load_experts(
        self, reader: WeightSource, hf: str, me: str, param: Callable[[str], torch.Tensor]
    ) -> None:
        """The router whole; this rank's experts' slice of gate and up (rows) and down (columns):
        every expert's slice under TP, a share of the experts whole under EP."""
        spec, (start, end) = self.family.moe, self.expert_range
        assert spec is not None  # called for a sparse layer only
        first, last = self.expert_ids
        gate, up, down = spec.names
        base = hf + spec.prefix + "."
        reader.copy_rows(param(me + "mlp.gate.weight"), base + "gate.weight")
        for e in range(spec.num_experts):
            theirs, mine = f"{base}experts.{e}.", f"{me}mlp.experts.{e - first}."
            if not first <= e < last:  # another rank's
                for name in (gate, up, down):
                    reader.skip(theirs + f"{name}.weight")
                continue
            reader.stack_rows(
                param(mine + "gate_up_proj.weight"),
                [(theirs + f"{gate}.weight", start, end), (theirs + f"{up}.weight", start, end)],
            )
            reader.copy_cols(
                param(mine + "down_proj.weight"), theirs + f"{down}.weight", start, end
            )
