"""LLaVA (`LlavaForConditionalGeneration`): a vision tower (CLIP's or SigLIP's, `vision.py`) and
a projector that turns each image into as many rows of the text model's embedding space as it has
placeholder tokens: transformers' `get_image_features`.

The features: the tower's hidden states at `vision_feature_layer` (one index, or several whose
states are concatenated along the width, in the order listed; negative indices count from the
last layer's output, as Python's do, over the embeddings' state and the N layers' outputs),
without each image's first token where `vision_feature_select_strategy` is "default" (CLIP's
class token; "full" keeps every token), through the projector: linear_1, the config's
`projector_hidden_act`, linear_2 (biased where `multimodal_projector_bias`, the default).

How the text model takes them (`LlavaForConditionalGeneration`, the served model): the
processor (`LlavaProcessor`) expands each `<image>` of a prompt into `tokens_per_image` copies of
the config's `image_token_index` ((S / P)^2 patches for images of S x S pixels in patches of P,
plus the class token, less one where the strategy is "default": 576 for LLaVA-1.5's 336-pixel
CLIP ViT-L/14), and the image's features row j is written over the embedding at its j-th
placeholder (transformers' `masked_scatter` of the image features into `inputs_embeds`, before
the first layer). A step that extends a request from a cached prefix, or one chunk of a long
prefill, covers only the placeholders at positions in [prefix, prefix + extend): the batch
names those rows and the features' rows they take (`ForwardBatch.image_embeds`, which the
runner fills from its cache of features by image content). The ids at the placeholders are
never looked up for their own embedding, so the radix tree keys them by the image's content
(ids past the vocabulary, each image's own): the decoder clamps every id into the vocabulary
before its lookup, and the rows those ids got are overwritten.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.distributed.group import TPGroup
from radixrt.forward_batch import ForwardBatch
from radixrt.models.decoder import RenamedSource
from radixrt.models.interface import WeightSource
from radixrt.models.llama import LlamaForCausalLM
from radixrt.models.vision import FeedForward, VisionTower

# where the savers put the vision tower's and the projector's tensors: (tower, projector)
# prefixes, the first a checkpoint holds is read
CHECKPOINT_LAYOUTS = (
    ("vision_tower.vision_model.", "multi_modal_projector."),  # the Hub's, transformers 4's
    ("vision_tower.", "multi_modal_projector."),  # transformers 5's save_pretrained
    ("model.vision_tower.vision_model.", "model.multi_modal_projector."),  # LlavaModel's own
    ("model.vision_tower.", "model.multi_modal_projector."),
)
# where the savers put the text model's tensors: the prefixes that stand for Llama's `model.`
# and `lm_head.`, the first a checkpoint holds an embedding under is read
LANGUAGE_LAYOUTS = (
    ("language_model.model.", "language_model.lm_head."),  # the Hub's, transformers 5's save
    ("model.language_model.", "lm_head."),  # transformers 5's module names
)
# the text models' `model_type`s the Llama decoder serves under LLaVA
TEXT_MODELS = ("llama", "mistral")
# the projector's linears: ours (`FeedForward`) -> the checkpoint's
PROJECTOR_NAMES = {"fc1": "linear_1", "fc2": "linear_2"}
# `vision_feature_select_strategy` -> the tokens dropped from the front of each hidden state
SELECT_STRATEGIES = {"default": 1, "full": 0}


def feature_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """The hidden states `vision_feature_layer` names (an int or a list), as indices in
    0..num_hidden_layers (0: the embeddings, i: layer i's output); ValueError for one outside."""
    layers: int = config.vision_config.num_hidden_layers
    named = config.vision_feature_layer
    indices = [named] if isinstance(named, int) else list(named)
    outside = [i for i in indices if not -(layers + 1) <= i <= layers]
    if not indices or outside:
        raise ValueError(
            f"config.json: vision_feature_layer {named!r} names no hidden state of a "
            f"{layers}-layer tower"
        )
    return tuple(i % (layers + 1) for i in indices)


class LlavaImageEncoder(nn.Module):
    """Pixel values [images, 3, S, S] -> each image's features [images, `tokens_per_image`,
    text hidden size], in the parameters' dtype: the tower only as deep as its deepest feature
    layer, and the projector. Built on the meta device like the text model and filled by
    `load_weights` from a `LlavaForConditionalGeneration` checkpoint (any of
    `CHECKPOINT_LAYOUTS`)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        vision, text = config.vision_config, config.text_config
        strategy = config.vision_feature_select_strategy
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"config.json: vision_feature_select_strategy {strategy!r} is none of "
                f"{sorted(SELECT_STRATEGIES)}"
            )
        self.dropped = SELECT_STRATEGIES[strategy]
        self.wanted = feature_layers(config)
        self.vision_tower = VisionTower(vision, max(self.wanted))
        widths = (vision.hidden_size * len(self.wanted), text.hidden_size, text.hidden_size)
        self.multi_modal_projector = FeedForward(
            widths,
            config.projector_hidden_act,
            bias=getattr(config, "multimodal_projector_bias", True),
        )

    @property
    def tokens_per_image(self) -> int:
        """The features of one image: the placeholder tokens its `<image>` expands into."""
        return self.vision_tower.tokens - self.dropped

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixels, self.wanted)
        selected = torch.cat([s[:, self.dropped :] for s in states], dim=-1)
        out: torch.Tensor = self.multi_modal_projector(selected)
        return out

    def load_weights(self, reader: WeightSource) -> None:
        """The tower's and the projector's tensors, under the first of `CHECKPOINT_LAYOUTS`'
        prefixes the checkpoint has a tower under (the text model's are not read here).
        ValueError when it has none, or for a tensor missing or of the wrong shape."""
        tower, projector = checkpoint_layout(reader)
        self.vision_tower.load_weights(reader, tower)
        for name, param in self.multi_modal_projector.named_parameters():
            linear, _, kind = name.partition(".")
            reader.copy_rows(param.data, f"{projector}{PROJECTOR_NAMES[linear]}.{kind}")


def first_layout(
    reader: WeightSource, layouts: tuple[tuple[str, str], ...], probe: str, what: str
) -> tuple[str, str]:
    """The first of `layouts` (prefix pairs) whose first prefix + `probe` the checkpoint holds
    (`WeightSource` lists no names: `skip` checks one is present, counting it read, as its
    load will); ValueError naming `what` when none is."""
    for first, second in layouts:
        try:
            reader.skip(first + probe)
        except ValueError:
            continue
        return first, second
    tried = [first + probe for first, _ in layouts]
    raise ValueError(f"the checkpoint has no {what}: none of {tried}")


def checkpoint_layout(reader: WeightSource) -> tuple[str, str]:
    """The (tower, projector) prefixes of the first of `CHECKPOINT_LAYOUTS` whose patch
    embedding the checkpoint holds."""
    probe = "embeddings.patch_embedding.weight"
    return first_layout(reader, CHECKPOINT_LAYOUTS, probe, "vision tower")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The served LLaVA: the Llama decoder over `config.text_config` (its tensors under the
    first of `LANGUAGE_LAYOUTS` the checkpoint has), and beside it the image encoder, which the
    runner calls once per image content (`encode`). `embed` writes a step's image features
    (`ForwardBatch.image_embeds`) over the placeholders' embeddings.

    The encoder is kept out of the module tree: what the loader and the runner do to the
    model's modules (packing or quantizing its linears, LoRA, the weight counts of the bench's
    floors) is the text model's alone; it is given storage, in the text model's dtype and on
    its device, by `load_weights`, and a weight update hands it over (`adopt_image_encoder`).
    One rank: the runner encodes on rank 0, and a step's features are not sent to the others."""

    def __init__(self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None):
        if tp is not None and tp.size > 1:
            raise ValueError("LlavaForConditionalGeneration is served on one rank (--tp-size 1)")
        text = config.text_config
        if text.model_type not in TEXT_MODELS:
            raise ValueError(
                f"config.json: a LLaVA text model of type {text.model_type!r} is not served; "
                f"supported: {list(TEXT_MODELS)}"
            )
        super().__init__(text, max_positions, tp)
        self.image_token_index: int = config.image_token_index
        self._encoder = [LlavaImageEncoder(config)]  # a list: not registered as a submodule

    @property
    def image_encoder(self) -> LlavaImageEncoder:
        return self._encoder[0]

    @property
    def tokens_per_image(self) -> int:
        """The placeholders each image fills (its features' rows)."""
        return self.image_encoder.tokens_per_image

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values [images, 3, S, S] -> their features [images, tokens_per_image, hidden]."""
        features: torch.Tensor = self.image_encoder(pixels)
        return features

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The tokens' embeddings, each id clamped into the vocabulary first (an image's
        placeholders carry ids past it, keyed by the image's content; a speculative draft copied
        from the prompt may too, and is rejected), then the step's image features written over
        their placeholders' rows."""
        ids = batch.input_ids.clamp(max=self.config.vocab_size - 1)
        x = super().embed(dataclasses.replace(batch, input_ids=ids))
        for row, features in batch.image_embeds or ():
            x[row : row + len(features)] = features.to(x.dtype)
        return x

    def load_weights(self, reader: WeightSource) -> None:
        """The text model's tensors through `LanguageModel` (its layout found first), then the
        image encoder's, into storage made like the text model's parameters."""
        super().load_weights(LanguageModel(reader, *language_layout(reader)))
        like = self.norm.weight
        encoder = self.image_encoder.to_empty(device=like.device).to(like.dtype)
        encoder.requires_grad_(False)
        encoder.load_weights(reader)
        encoder.eval()

    def adopt_image_encoder(self, staged: LlavaForConditionalGeneration) -> None:
        """Serve `staged`'s image encoder (loaded from new weights) from now on."""
        self._encoder = [staged.image_encoder]


def language_layout(reader: WeightSource) -> tuple[str, str]:
    """The (decoder, output projection) prefixes of the first of `LANGUAGE_LAYOUTS` whose
    embedding the checkpoint holds."""
    return first_layout(reader, LANGUAGE_LAYOUTS, "embed_tokens.weight", "text model")


class LanguageModel(RenamedSource):
    """A `WeightSource` that reads a LLaVA checkpoint's text model by Llama's names: `model.X`
    as `decoder` + X, `lm_head.X` as `head` + X."""

    def __init__(self, reader: WeightSource, decoder: str, head: str):
        self.reader, self.decoder, self.head = reader, decoder, head

    def name(self, ours: str) -> str:
        if ours.startswith("model."):
            return self.decoder + ours.removeprefix("model.")
        if ours.startswith("lm_head."):
            return self.head + ours.removeprefix("lm_head.")
        raise ValueError(f"{ours!r} is no tensor of a Llama decoder")
