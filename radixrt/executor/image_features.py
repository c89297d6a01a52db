"""A vision-language model's image features, computed in the runner once per image content.

A step names the image placeholders among its new tokens (`ForwardBatch.images`: the batch's
rows, the image's content key and picture, the features' rows they take); `rows` gives the
model what to write over those rows (`ForwardBatch.image_embeds`). The features of each key are
kept in an LRU cache of at most FEATURE_CACHE_BYTES: a resent image, a later chunk of a long
prefill and a request readmitted after a preemption find them there, and only a miss
preprocesses the picture (the checkpoint's preprocessor_config.json, `ClipImageProcessor`) and
runs the encoder. Each image is encoded alone, so its features do not depend on what else the
step holds (a batch of several would change the encoder's sums' order, and so the bits); the
one just encoded is kept even when it alone is past the bound.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from PIL import Image

from radixrt.forward_batch import ImagePart
from radixrt.models.llava import LlavaForConditionalGeneration
from radixrt.multimodal.processors import ClipImageProcessor

# LLaVA-1.5-7B's features are 576 x 4096 values, 4.7 MB in bfloat16: about 50 images
FEATURE_CACHE_BYTES = 256 << 20


class ImageFeatures:
    """The features of `model`'s images by content key, from pictures preprocessed as the
    checkpoint folder's preprocessor_config.json says; `encoder_calls` counts the images
    encoded (the `image_encoder_calls` stat)."""

    def __init__(self, model: LlavaForConditionalGeneration, folder: Path):
        self.model = model
        self.processor = ClipImageProcessor.from_folder(folder)
        side = model.image_encoder.vision_tower.embeddings.image_size
        made = self.processor.crop or self.processor.size
        if made != (side, side):
            raise ValueError(
                f"preprocessor_config.json makes images of {made or 'varying'} pixels; the "
                f"vision tower takes {side} x {side}"
            )
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cached_bytes = 0
        self.encoder_calls = 0

    @property
    def preprocessing(self) -> str:
        """What the pictures go through before the encoder, described (part of the images'
        pseudo ids, `engine.images`)."""
        return repr(self.processor)

    @property
    def image_token_index(self) -> int:
        return self.model.image_token_index

    @property
    def tokens_per_image(self) -> int:
        return self.model.tokens_per_image

    def rows(self, parts: list[ImagePart]) -> list[tuple[int, torch.Tensor]]:
        """(the batch's first row, the features' rows written from there) of each part."""
        return [(p.row, self.of(p.key, p.picture)[p.first : p.first + p.count]) for p in parts]

    def of(self, key: str, picture: Image.Image) -> torch.Tensor:
        """The features [tokens_per_image, hidden] of the image whose content key is `key`."""
        features = self.cache.get(key)
        if features is not None:
            self.cache.move_to_end(key)
            return features
        weight = self.model.norm.weight
        pixels = torch.from_numpy(self.processor(picture))[None].to(weight.device)
        features = self.model.encode(pixels)[0]
        self.encoder_calls += 1
        self.cache[key] = features
        self.cached_bytes += features.nbytes
        while self.cached_bytes > FEATURE_CACHE_BYTES and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self.cached_bytes -= old.nbytes
        return features

    def clear(self) -> None:
        """Forget every image's features (new weights make them stale)."""
        self.cache.clear()
        self.cached_bytes = 0
