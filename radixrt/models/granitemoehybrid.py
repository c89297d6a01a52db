"""IBM Granite 4 (`GraniteMoeHybridForCausalLM`): Bamba's Mamba-2 layers ("linear_attention" in
`layer_types`) beside attention layers (the -h models; Granite-4.0-micro's layers are all
attention), each layer's MLP the shared MLP every token runs (`shared_mlp`, its gate and up rows
fused in `input_linear`) and, where the config has experts (`num_local_experts` > 0: -h-tiny,
-h-small), routed experts beside it: the top k of the router's logits, softmaxed among
themselves, with the shared MLP's output added ungated. Four of the config's scalars scale the
arithmetic: the embeddings by `embedding_multiplier`, each mixer's and each MLP's output by
`residual_multiplier` before it joins the stream, the attention scores by `attention_multiplier`
(in place of 1/sqrt(head_dim)), and the logits are divided by `logits_scaling`. Attention
rotates by position only where `position_embedding_type` is "rope" (the -h models' "nope": the
Mamba layers order the tokens). The checkpoint stacks a layer's experts in one tensor each
([E, 2I, H] gate and up, [E, H, I] down), read an expert at a time: so an expert's intermediate
dimension is never split over ranks. A model with Mamba layers is served on one rank (their
state per request); none is served with adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from radixrt.distributed.group import TPGroup
from radixrt.models.bamba import BambaForCausalLM
from radixrt.models.family import Family, MoeSpec, decoder_family
from radixrt.models.interface import WeightSource


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Bamba's layer kinds and Mamba-2 mixers (`layer_kinds_of`, `make_mixer`, `load_mixer`: the
    same config fields and tensors), under Granite 4's MLPs, names and scalars."""

    # the dense MLP is the shared MLP: gate and up rows fused (`fused_checkpoint`), and down
    CHECKPOINT_NAMES = {
        "mlp.gate_up_proj.weight": "shared_mlp.input_linear.weight",
        "mlp.down_proj.weight": "shared_mlp.output_linear.weight",
    }

    @classmethod
    def family_of(cls, config: PretrainedConfig) -> Family:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        moe = None
        if config.num_local_experts:
            moe = MoeSpec(
                num_experts=config.num_local_experts,
                top_k=config.num_experts_per_tok,
                intermediate_size=config.intermediate_size,
                renormalize=True,
                prefix="block_sparse_moe",
                names=("input_linear", "input_linear", "output_linear"),
                sparse_layers=frozenset(range(config.num_hidden_layers)),
                shared_intermediate_size=config.shared_intermediate_size,
                shared_gate=False,
                top_k_first=True,
            )
        return decoder_family(
            config,
            fused_checkpoint=frozenset({"gate_up_proj"}),
            moe=moe,
            embed_scale=float(config.embedding_multiplier),
            query_scale=float(config.attention_multiplier) * head_dim**0.5,
            rotary=config.position_embedding_type == "rope",
            residual_scale=float(config.residual_multiplier),
            logits_divisor=float(config.logits_scaling),
        )

    @classmethod
    def intermediate_size_of(cls, config: PretrainedConfig) -> int:
        """The shared MLP's width: the dense MLP where there are no experts."""
        width: int = config.shared_intermediate_size
        return width

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None):
        """After a ValueError where tensor parallelism would split each expert (an
        all-attention model with experts, under --tp-size without --ep-size): the stacked
        tensors are read an expert at a time, whole."""
        super().__init__(config, max_positions, tp)
        moe = self.family.moe
        if moe is not None and self.expert_range != (0, moe.intermediate_size):
            raise ValueError(
                f"{type(self).__name__}'s experts are stacked in one tensor: serve it with "
                "--ep-size (experts whole on each rank) or on one rank"
            )

    def _load_experts(
        self, reader: WeightSource, hf: str, me: str, param: Callable[[str], torch.Tensor]
    ) -> None:
        """The router (`router.layer`) and the shared MLP whole; this rank's experts, each
        one [1, ...] row of the stacked `input_linear` [E, 2I, H] (gate rows, then up) and
        `output_linear` [E, H, I]."""
        spec, (first, last) = self.family.moe, self.expert_ids
        assert spec is not None  # called for a sparse layer only
        base = f"{hf}{spec.prefix}."
        reader.copy_rows(param(me + "mlp.gate.weight"), base + "router.layer.weight")
        shared = me + "mlp.shared_expert."
        reader.copy_rows(
            param(shared + "gate_up_proj.weight"), hf + "shared_mlp.input_linear.weight"
        )
        reader.copy_rows(param(shared + "down_proj.weight"), hf + "shared_mlp.output_linear.weight")
        for e in range(first, last):
            mine = f"{me}mlp.experts.{e - first}."
            for ours, theirs in (("gate_up_proj", "input_linear"), ("down_proj", "output_linear")):
                reader.copy_rows(
                    param(f"{mine}{ours}.weight")[None], f"{base}{theirs}.weight", e, e + 1
                )
