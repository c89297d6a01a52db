"""LLaVA (`LlavaForConditionalGeneration`): a vision tower (CLIP's or SigLIP's, `vision.py`) and
a projector that turns each image into as many rows of the text model's embedding space as it has
placeholder tokens: transformers' `get_image_features`.

The features: the tower's hidden states at `vision_feature_layer` (one index, or several whose
states are concatenated along the width, in the order listed; negative indices count from the
last layer's output, as Python's do, over the embeddings' state and the N layers' outputs),
without each image's first token where `vision_feature_select_strategy` is "default" (CLIP's
class token; "full" keeps every token), through the projector: linear_1, the config's
`projector_hidden_act`, linear_2 (biased where `multimodal_projector_bias`, the default).

How the text model takes them (the serving step; nothing here is wired into it yet): the
processor (`LlavaProcessor`) expands each `<image>` of a prompt into `tokens_per_image` copies of
the config's `image_token_index` ((S / P)^2 patches for images of S x S pixels in patches of P,
plus the class token, less one where the strategy is "default": 576 for LLaVA-1.5's 336-pixel
CLIP ViT-L/14). A request then carries its images' features in prompt order (a list of
[tokens_per_image, text hidden] tensors, or their concatenation) and the positions of its
placeholder tokens; after `embed_tokens` looks its ids up, the decoder writes the features' row j
over the embedding at the j-th placeholder position (transformers' `masked_scatter` of the image
features into `inputs_embeds`, before the first layer). A step that extends a request from a
cached prefix, or one chunk of a long prefill, covers only the placeholders at positions in
[prefix, prefix + extend): it takes the features' rows of those, so an image's features must stay
at hand (cached by the image's content) until its last placeholder has been prefilled. The ids at
the placeholders are never looked up for their own embedding, so the radix tree may key them by
the image's content instead, as long as the decoder is given `image_token_index` (or any id in
the vocabulary) there.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.interface import WeightSource
from radixrt.models.vision import FeedForward, VisionTower

# where the savers put the vision tower's and the projector's tensors: (tower, projector)
# prefixes, the first a checkpoint holds is read
CHECKPOINT_LAYOUTS = (
    ("vision_tower.vision_model.", "multi_modal_projector."),  # the Hub's, transformers 4's
    ("vision_tower.", "multi_modal_projector."),  # transformers 5's save_pretrained
    ("model.vision_tower.vision_model.", "model.multi_modal_projector."),  # LlavaModel's own
    ("model.vision_tower.", "model.multi_modal_projector."),
)
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


def checkpoint_layout(reader: WeightSource) -> tuple[str, str]:
    """The (tower, projector) prefixes of the first of `CHECKPOINT_LAYOUTS` whose patch
    embedding the checkpoint holds (`WeightSource` lists no names: `skip` checks one is present,
    counting it read, as its load will)."""
    probe = "embeddings.patch_embedding.weight"
    for tower, projector in CHECKPOINT_LAYOUTS:
        try:
            reader.skip(tower + probe)
        except ValueError:
            continue
        return tower, projector
    tried = [tower + probe for tower, _ in CHECKPOINT_LAYOUTS]
    raise ValueError(f"the checkpoint has no vision tower: none of {tried}")
