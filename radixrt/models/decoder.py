"""The attention decoder every attention-only family derives (Llama, Mistral, Qwen2, SmolLM,
Qwen3, Phi-3/4, Mixtral, Qwen3-MoE, Gemma 2/3) over a flattened ragged batch: embedding, per
layer `layers.DecoderLayer`, a final norm and the output projection, loaded from Hugging Face's
tensor names. What a family swaps in (norms, biases, a sparse MLP, fused checkpoint tensors) is
its `Family`, which its class's `family_of` reads from the config."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.attention import AttentionBackend
from radixrt.distributed.group import TPGroup
from radixrt.distributed.sharding import shard_heads, split_range
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels.int4_gemm import PackedGroups
from radixrt.models.family import Family, rope_per_layer_type
from radixrt.models.fused_decode import FusedDecode
from radixrt.models.interface import CausalLM, Projection, WeightSource
from radixrt.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    PackedEmbedding,
    RMSNorm,
    RotaryEmbedding,
    StatefulMixer,
    VocabParallelEmbedding,
    VocabSlice,
    expert_shard,
)
from radixrt.models.moe import SparseMoE


class Decoder(CausalLM):
    """The attention decoder, or with `tp` of size N one rank's shard of it: its heads
    (`shard`), its slice of the MLP (`mlp_range`), of each expert (`expert_range`) and of the
    vocabulary (`vocab_range`); norms, routers and rotary tables are whole on every rank.
    `compute_logits` gives this rank's vocabulary columns. `graph_safe` says whether a decode
    step may be captured as a CUDA graph (not with experts: their grouping reads counts).
    A family's class derives it and says, in `family_of`, which parts its config swaps in; a
    family whose layers mix by something other than attention on some layers (LFM2's short
    convolutions) names each layer's kind (`layer_kinds_of`) and builds and loads those mixers
    (`make_mixer`, `load_mixer`). The KV pool holds the attending layers only (`kv_layers`;
    attending layer i writes the pool's layer `kv_layer_of[i]`)."""

    # the checkpoint's tensor names where they differ from Llama's: Llama's name (within a
    # layer, after `model.layers.N.`, or whole) -> the checkpoint's
    CHECKPOINT_NAMES: dict[str, str] = {}
    # the layer kinds that attend, each layer of them writing a KV-pool layer of its own:
    # attention, and a family's kind whose mixer holds an attention beside another mixer
    # (Falcon-H1's "hybrid", its mixer built by `mixer_of`)
    ATTENDING: frozenset[str] = frozenset({"attention"})

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        """The parts this architecture swaps into the decoder, read from `config`."""
        raise NotImplementedError

    @classmethod
    def layer_kinds_of(cls, config: PretrainedConfig) -> tuple[str, ...]:
        """Each layer's mixer: "attention", or a kind `make_mixer` builds."""
        layers: int = config.num_hidden_layers
        return ("attention",) * layers

    @classmethod
    def intermediate_size_of(cls, config: PretrainedConfig) -> int:
        """The dense MLP's width."""
        width: int = config.intermediate_size
        return width

    def make_mixer(self, kind: str, config: PretrainedConfig) -> tuple[str, nn.Module]:
        """(its name in the layer and the checkpoint, the module) of a layer of `kind` other
        than attention."""
        raise ValueError(f"{type(self).__name__} has no {kind!r} layers")

    def load_mixer(
        self,
        reader: WeightSource,
        kind: str,
        hf: str,
        me: str,
        param: Callable[[str], torch.Tensor],
    ) -> None:
        """A `make_mixer` layer's tensors (`hf`: its checkpoint prefix, `me`: its module's)."""
        raise ValueError(f"{type(self).__name__} has no {kind!r} layers")

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.family = family = self.family_of(config)
        self.graph_safe = family.moe is None
        self.tp = tp = tp or TPGroup()
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.head_dim = head_dim
        self.shard = shard_heads(
            config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank
        )
        self.intermediate_size = self.intermediate_size_of(config)
        self.mlp_range = split_range(self.intermediate_size, tp.size, tp.rank)
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
        self.layer_kinds = self.layer_kinds_of(config)
        if len(self.layer_kinds) != config.num_hidden_layers:
            raise ValueError(
                f"config.json: layer_types names {len(self.layer_kinds)} layers, "
                f"num_hidden_layers is {config.num_hidden_layers}"
            )
        self.recurrent = any(kind != "attention" for kind in self.layer_kinds)
        if self.recurrent:  # its mixers' states are whole on one rank; its steps read the host
            if tp.size > 1:
                raise ValueError(f"{type(self).__name__} is served on one rank (--tp-size 1)")
            self.graph_safe = False
        attention = [i for i, kind in enumerate(self.layer_kinds) if kind in self.ATTENDING]
        if family.windows:  # the attention backend reads them by KV-pool layer
            windows = tuple(family.windows[i] for i in attention)
            self.family = family = dataclasses.replace(family, windows=windows)
        self.kv_layer_of = {layer: n for n, layer in enumerate(attention)}
        self.kv_layers = len(attention)
        self.layers = nn.ModuleList(
            DecoderLayer(config, family, i, self.mixer_of(config, i), widths, self.expert_ids, tp)
            for i in range(config.num_hidden_layers)
        )
        # found once: a snapshot's copy (at admissions and chunk ends) walks these, not every module
        self.stateful = [m for m in self.layers.modules() if isinstance(m, StatefulMixer)]
        self.norm = RMSNorm(config.hidden_size, family.norm_eps)
        # rotary tables by layer type ("all" where one serves every layer)
        self.rope_of_layer = family.rope_by_layer or ("all",) * config.num_hidden_layers
        self.rope = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    config,
                    head_dim,
                    max_positions,
                    kind if rope_per_layer_type(config) else None,
                    family.rotary,
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

    def mixer_of(self, config: PretrainedConfig, i: int) -> tuple[str, nn.Module]:
        """Layer i's mixer (its name in the layer, the module): attention (`attention_of`), or
        what `make_mixer` builds for its kind. A family whose mixer holds the layer's own
        attention (an `ATTENDING` kind) overrides it: the layer's KV-pool layer is its own."""
        kind = self.layer_kinds[i]
        if kind != "attention":
            return self.make_mixer(kind, config)
        return "self_attn", self.attention_of(config, i)

    def attention_of(self, config: PretrainedConfig, i: int) -> Attention:
        """Layer i's attention over this rank's heads, writing the KV pool's layer
        `kv_layer_of[i]` (i must be an attending layer)."""
        kv = self.kv_layer_of[i]
        return Attention(config, self.family, kv, self.head_dim, self.shard, self.tp)

    def allocate_states(self, slots: int, ssm_dtype: torch.dtype) -> list[torch.Tensor]:
        """Every stateful mixer's state buffers for `slots` state slots, in layer order."""
        return [t for mixer in self.stateful for t in mixer.allocate_state(slots, ssm_dtype)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, one row per new token (the same on every rank)."""
        x, residual = self.embed(batch), None
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

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The first layer's input: the new tokens' embeddings, scaled where the family says. A
        model whose inputs are not all tokens (images') overrides it."""
        x: torch.Tensor = self.embed_tokens(batch.input_ids)
        if self.family.embed_scale != 1.0:
            x = x * torch.tensor(self.family.embed_scale, dtype=x.dtype)
        return x

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

    def projections(self) -> dict[tuple[int, str], Projection]:
        """Each layer's fused q/k/v and output projections, and its dense MLP's gate/up and
        down (a layer of experts has none): column-parallel but for o and down, which take
        this rank's columns of the heads' and the MLP's widths."""
        c, s, hd = self.config, self.shard, self.head_dim
        q, kv = (s.q_start * hd, s.q_end * hd), (s.kv_start * hd, s.kv_end * hd)
        heads, kv_heads = c.num_attention_heads * hd, c.num_key_value_heads * hd
        hidden, mlp, inter = c.hidden_size, self.mlp_range, self.intermediate_size
        found = {}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            if layer.mixer_name != "self_attn":
                continue
            attn = layer.get_submodule("self_attn")
            found[i, "qkv"] = Projection(
                attn, "qkv_proj", ("q", "k", "v"), (q, kv, kv), (heads, kv_heads, kv_heads), hidden
            )
            found[i, "o"] = Projection(attn, "o_proj", ("o",), ((0, hidden),), (hidden,), heads, q)
            if isinstance(layer.mlp, MLP):
                found[i, "gate_up"] = Projection(
                    layer.mlp, "gate_up_proj", ("gate", "up"), (mlp, mlp), (inter, inter), hidden
                )
                found[i, "down"] = Projection(
                    layer.mlp, "down_proj", ("down",), ((0, hidden),), (hidden,), inter, mlp
                )
        return found

    def _fused_decode(self) -> FusedDecode | None:
        """The one-call decode path (`fused_decode`), decided at the first step: the linears
        are packed by then."""
        if not self._fused_checked:
            self._fused, self._fused_checked = FusedDecode.of(self), True
        return self._fused

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary slice (multiplied or divided, then soft-capped,
        where the family says)."""
        cap, divisor = self.family.final_logit_softcap, self.family.logits_divisor
        logits: torch.Tensor = self.lm_head(hidden)
        if self.family.logits_scale != 1.0:
            logits = logits * self.family.logits_scale
        if divisor != 1.0:
            logits = logits / divisor
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, reader: WeightSource) -> None:
        """Load Hugging Face names into the parameters in place, reading only this rank's
        slices: q/k/v and gate/up fused (from separate tensors, or rows of Phi-3's fused ones),
        experts' as the dense MLP's; a family's other mixers by its `load_mixer`, and its own
        tensor names by `CHECKPOINT_NAMES`. ValueError for a tensor missing or of the wrong
        shape."""
        if self.CHECKPOINT_NAMES:
            reader = Renamed(reader, self.CHECKPOINT_NAMES)
        own = dict(self.named_parameters())
        loaded = set()

        def param(name: str) -> torch.Tensor:
            """The parameter `name`'s storage, to fill (and counted as loaded)."""
            loaded.add(name)
            data: torch.Tensor = own[name].data
            return data

        for i, layer in enumerate(self.layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            norms = ["input_layernorm", "post_attention_layernorm"]
            if self.layer_kinds[i] != "attention":
                self.load_mixer(reader, self.layer_kinds[i], hf, me, param)
            else:
                self.load_attention(reader, hf + "self_attn.", me + "self_attn.", param)
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

    def load_attention(
        self, reader: WeightSource, hf: str, me: str, param: Callable[[str], torch.Tensor]
    ) -> None:
        """An `attention_of` module's tensors (`hf`: its checkpoint prefix, `me`: its module's,
        each ending in `self_attn.`): this rank's rows of q, k and v fused (their biases too
        where the family has them), its columns of o, and the family's q/k norms."""
        for kind in ("weight", "bias") if self.family.qkv_bias else ("weight",):
            reader.stack_rows(param(me + f"qkv_proj.{kind}"), self._qkv(hf, kind))
        q = (self.shard.q_start * self.head_dim, self.shard.q_end * self.head_dim)
        reader.copy_cols(param(me + "o_proj.weight"), hf + "o_proj.weight", *q)
        if self.family.qk_norm:
            for norm in ("q_norm", "k_norm"):
                param(me + f"{norm}.weight").copy_(self._norm(reader, hf + f"{norm}.weight"))

    def _norm(self, reader: WeightSource, name: str) -> torch.Tensor:
        """An RMSNorm's weight as the norm multiplies by it: Gemma stores it less 1 (added in
        the stored dtype, as before any cast)."""
        return reader.whole(name) + self.family.norm_offset

    def _qkv(self, hf: str, kind: str) -> list[tuple[str, int, int]]:
        """This rank's rows of q, k and v, one after the other, under the attention's checkpoint
        prefix `hf`: (name, start, end) each."""
        s, hd, heads = self.shard, self.head_dim, self.config.num_attention_heads
        kv_heads = self.config.num_key_value_heads
        q = 2 * hd if self.family.attn_output_gate else hd  # a gate's rows after each query's
        spans = [
            (s.q_start * q, s.q_end * q),
            (s.kv_start * hd, s.kv_end * hd),
            (s.kv_start * hd, s.kv_end * hd),
        ]
        if "qkv_proj" in self.family.fused_checkpoint:  # rows of [q; k; v] in one tensor
            offsets = (0, heads * hd, (heads + kv_heads) * hd)
            name = hf + f"qkv_proj.{kind}"
            return [(name, o + a, o + b) for o, (a, b) in zip(offsets, spans)]
        names = [hf + f"{p}_proj.{kind}" for p in "qkv"]
        return [(n, *span) for n, span in zip(names, spans)]

    def _gate_up(self, prefix: str) -> list[tuple[str, int, int]]:
        """This rank's rows of the dense MLP's gate, then of its up projection."""
        start, end = self.mlp_range
        if "gate_up_proj" in self.family.fused_checkpoint:  # rows of [gate; up] in one tensor
            width = self.intermediate_size
            name = prefix + "gate_up_proj.weight"
            return [(name, start, end), (name, width + start, width + end)]
        return [(prefix + f"{p}_proj.weight", start, end) for p in ("gate", "up")]

    def _load_experts(
        self, reader: WeightSource, hf: str, me: str, param: Callable[[str], torch.Tensor]
    ) -> None:
        """The router whole; this rank's experts' slice of gate and up (rows) and down (columns):
        every expert's slice under TP, a share of the experts whole under EP; a shared expert
        and its gate whole."""
        spec, (start, end) = self.family.moe, self.expert_range
        assert spec is not None  # called for a sparse layer only
        first, last = self.expert_ids
        gate, up, down = spec.names
        base = hf + spec.prefix + "."
        reader.copy_rows(param(me + "mlp.gate.weight"), base + "gate.weight")
        if spec.shared_intermediate_size:
            shared, mine = base + "shared_expert.", me + "mlp.shared_expert."
            width = spec.shared_intermediate_size
            reader.stack_rows(
                param(mine + "gate_up_proj.weight"),
                [(shared + f"{gate}.weight", 0, width), (shared + f"{up}.weight", 0, width)],
            )
            reader.copy_rows(param(mine + "down_proj.weight"), shared + f"{down}.weight")
            reader.copy_rows(
                param(me + "mlp.shared_expert_gate.weight"), base + "shared_expert_gate.weight"
            )
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


class RenamedSource:
    """A `WeightSource` over another one (`reader`), each tensor read by the name `name` gives
    for ours."""

    reader: WeightSource

    def name(self, ours: str) -> str:
        raise NotImplementedError

    def whole(self, name: str) -> torch.Tensor:
        return self.reader.whole(self.name(name))

    def copy_rows(
        self, out: torch.Tensor, name: str, start: int | None = None, end: int | None = None
    ) -> None:
        self.reader.copy_rows(out, self.name(name), start, end)

    def stack_rows(self, out: torch.Tensor, parts: list[tuple[str, int, int]]) -> None:
        self.reader.stack_rows(out, [(self.name(n), a, b) for n, a, b in parts])

    def copy_cols(self, out: torch.Tensor, name: str, start: int, end: int) -> None:
        self.reader.copy_cols(out, self.name(name), start, end)

    def skip(self, name: str) -> None:
        self.reader.skip(self.name(name))


class Renamed(RenamedSource):
    """A `WeightSource` that reads a checkpoint by its own names: Llama's name of a tensor
    (within a layer, or whole) mapped through `names`, the rest as they are."""

    LAYER = re.compile(r"(model\.layers\.\d+\.)(.*)")

    def __init__(self, reader: WeightSource, names: dict[str, str]):
        self.reader, self.names = reader, names

    def name(self, ours: str) -> str:
        match = self.LAYER.fullmatch(ours)
        if match is None:
            return self.names.get(ours, ours)
        return match[1] + self.names.get(match[2], match[2])
