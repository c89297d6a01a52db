"""A request's images in its prompt: where each one's placeholders are, and the ids the radix
tree keys them by.

The caller gives the prompt's token ids with the model's `image_token_index` where each image
goes, in the images' order, in either of two forms:
- one placeholder per image (as a user writes `<image>` in a text): each is expanded here into
  the `tokens_per_image` placeholders the image's features fill;
- already expanded (as transformers' `LlavaProcessor` writes a prompt): `tokens_per_image`
  placeholders per image, each image's in one run.
Any other count of placeholders is refused, as is an image to a model without a vision tower.

In the ids the scheduler computes and caches (`Req.all_ids`), each image's run of placeholders
holds its pseudo id instead (SGLang's "pad value"): the vocabulary's size plus the first 60
bits of a hash of the image's content key (SHA-256 of its bytes) and of the preprocessing the
model applies (the disk tier's KV outlives a change of preprocessor_config.json, which the
model's fingerprint does not hash), the same at each of its positions. So
the text before an image is shared by every request, a request that resends the same bytes
finds the KV past the image in the tree, and two different images never share KV (their ids
differ at their first placeholder; 60 bits make a collision between two images about 2^-60).
The model never looks these ids up (`models.llava`: clamped, and the rows overwritten by the
image's features); the request's own `input_ids` keep `image_token_index` there, for its
prompt logprobs, penalties and detokenizing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from radixrt.multimodal.images import DecodedImage

KEY_HEX_DIGITS = 15  # 60 bits of the hash: vocab + 2^60 stays in an int64 token id


@dataclass(frozen=True)
class ImageSpan:
    """One image of a request: its placeholders are prompt positions [start, start + length),
    each holding the pseudo id `token` in `Req.all_ids`; `key` its content key and `picture`
    the image decoded (encoded only where the runner has no features of `key`)."""

    key: str
    picture: Image.Image
    start: int
    length: int
    token: int


def pseudo_id(key: str, preprocessing: str, vocab: int) -> int:
    """The id an image with content key `key` holds at its placeholders under `preprocessing`
    (a description of it): past the vocabulary, one per content and preprocessing."""
    digest = hashlib.sha256(f"{preprocessing}|{key}".encode()).hexdigest()
    return vocab + int(digest[:KEY_HEX_DIGITS], 16)


def place_images(
    input_ids: list[int],
    images: Sequence[DecodedImage],
    token: int,
    per_image: int,
    preprocessing: str,
    vocab: int,
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt with each image's placeholders expanded to `per_image` (where it has one
    each), and each image's span (its pseudo id under `preprocessing`); ValueError where the
    placeholders (`token`) are neither one nor `per_image` per image, or an image's expanded
    ones are not one run."""
    at = [i for i, t in enumerate(input_ids) if t == token]
    if len(at) == len(images) * per_image:
        starts = at[::per_image]
        runs = [at[i * per_image : (i + 1) * per_image] for i in range(len(images))]
        if any(run[-1] - run[0] != per_image - 1 for run in runs):
            raise ValueError(f"each image's {per_image} image tokens ({token}) must be one run")
        ids = list(input_ids)
    elif len(at) == len(images):
        ids, starts = [], []
        last = 0
        for i in at:
            ids += input_ids[last:i]
            starts.append(len(ids))
            ids += [token] * per_image
            last = i + 1
        ids += input_ids[last:]
    else:
        raise ValueError(
            f"{len(images)} images but {len(at)} image tokens ({token}): give one per image, "
            f"or {per_image} per image"
        )
    spans = tuple(
        ImageSpan(
            image.key, image.pixels, start, per_image, pseudo_id(image.key, preprocessing, vocab)
        )
        for image, start in zip(images, starts)
    )
    return ids, spans
