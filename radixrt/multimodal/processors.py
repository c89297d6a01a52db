"""An image to the pixel values a vision tower takes, as transformers' image processors compute
them on their Pillow/numpy path (`backend="pil"`, the "slow" processors; these machines have no
torchvision), from the parameters a checkpoint's preprocessor_config.json gives.

The CLIP family of processors (`CLIPImageProcessor`, LLaVA's `LlavaImageProcessor`,
`SiglipImageProcessor`): the image converted to RGB (transparency composited onto white), padded
to a square of the mean colour (LLaVA's `do_pad`), resized (its shortest edge to a length,
keeping the aspect ratio, or to a height and width) with the processor's Pillow filter
(`resample`, bicubic for these), cropped around its centre, rescaled (1/255) and normalized by
the processor's mean and std: [3, H, W] float32. Each step is transformers' own arithmetic in
the same order and dtypes (uint8 through Pillow, the rescale in float64 then float32, the
normalization in float32), so the values are the same bits, not merely close.

A processor is a frozen record of its parameters: two images keyed by content are the same
input only under the same record (what the radix tree's image keys must include besides the
bytes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PREPROCESSOR_CONFIG = "preprocessor_config.json"
MAX_CONFIG_BYTES = 1 << 20  # a processor's config is a few hundred bytes: past this, refused

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_DEFAULTS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_pad": False,
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "resample": Image.Resampling.BICUBIC,
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
}
# by `image_processor_type`: what a processor does where its config leaves a field out (the
# class's defaults in transformers); LLaVA's alone reads `do_pad` (a square of the mean colour)
DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": CLIP_DEFAULTS,
    "LlavaImageProcessor": CLIP_DEFAULTS,
    "SiglipImageProcessor": {
        **CLIP_DEFAULTS,
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
    },
}
PADS_TO_SQUARE = {"LlavaImageProcessor"}


@dataclass(frozen=True)
class ClipImageProcessor:
    """One processor's parameters (`from_config`), applied by calling it on an image.

    convert_rgb: the image is converted to RGB first (else it must be RGB already).
    square_fill: the RGB colour of the square it is padded to first; None: not padded.
    shortest_edge: the shortest edge resized to this, the other in proportion (truncated);
        `size`: resized to this (height, width) instead; both None: not resized.
    resample: the Pillow filter of the resize.
    crop: the (height, width) cut from the middle (zeros around an image smaller than it);
        None: not cropped.
    rescale: the factor each value is multiplied by; None: left as it is.
    mean, std: each channel's, subtracted and divided by; None: not normalized.
    """

    convert_rgb: bool
    square_fill: tuple[int, ...] | None
    shortest_edge: int | None
    size: tuple[int, int] | None
    resample: int
    crop: tuple[int, int] | None
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_folder(cls, folder: Path) -> ClipImageProcessor:
        """The processor of a checkpoint folder's preprocessor_config.json; ValueError, one
        line, for a file past `MAX_CONFIG_BYTES`, not JSON, or asking what this cannot do."""
        path = folder / PREPROCESSOR_CONFIG
        if not path.is_file():
            raise ValueError(f"{folder} has no {PREPROCESSOR_CONFIG}")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(
                f"{PREPROCESSOR_CONFIG}: past the {MAX_CONFIG_BYTES} bytes read of one"
            )
        try:
            config = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{PREPROCESSOR_CONFIG} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{PREPROCESSOR_CONFIG} is not a JSON object")
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ClipImageProcessor:
        """The processor a preprocessor_config.json's fields describe: its
        `image_processor_type` (or an older `feature_extractor_type`), less a "Fast" or "Pil"
        suffix, one of `DEFAULTS`, whose values fill the fields it leaves out. An int `size` is
        the shortest edge, an int `crop_size` a square (transformers' reading of older
        configs)."""
        kind = _processor_type(config)
        if kind not in DEFAULTS:
            raise ValueError(
                f"{PREPROCESSOR_CONFIG}: image processor {kind!r} is not supported; "
                f"supported: {sorted(DEFAULTS)}"
            )
        c = {**DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}
        if c["do_pad"] and kind not in PADS_TO_SQUARE:
            raise ValueError(f"{PREPROCESSOR_CONFIG}: do_pad is set for a {kind}")
        shortest, size = _resize_of(c["size"]) if c["do_resize"] else (None, None)
        return cls(
            convert_rgb=bool(c["do_convert_rgb"]),
            square_fill=(
                tuple(int(x * 255) for x in _per_channel(c["image_mean"])) if c["do_pad"] else None
            ),
            shortest_edge=shortest,
            size=size,
            resample=int(c["resample"]),
            crop=_crop_of(c["crop_size"]) if c["do_center_crop"] else None,
            rescale=float(c["rescale_factor"]) if c["do_rescale"] else None,
            mean=_per_channel(c["image_mean"]) if c["do_normalize"] else None,
            std=_per_channel(c["image_std"]) if c["do_normalize"] else None,
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        """`image`'s pixel values [3, H, W], float32."""
        if self.convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"a {image.mode} image, and the processor converts none to RGB")
        if self.square_fill is not None:
            image = pad_to_square(image, self.square_fill)
        if self.shortest_edge is not None or self.size is not None:
            height, width = self.resized_size(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        if self.crop is not None:
            pixels = center_crop(pixels, *self.crop)
        if self.rescale is not None:
            values = (pixels.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
            values = ((values - mean) / std).astype(np.float32, copy=False)
        return np.ascontiguousarray(values.transpose(2, 0, 1))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of `height` x `width` is resized to: `size`, or the
        shortest edge `shortest_edge` and the other int(shortest_edge * long / short)."""
        if self.size is not None:
            return self.size
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, an image with transparency (an alpha band, or a palette's transparent colour)
    composited onto white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def pad_to_square(image: Image.Image, fill: tuple[int, ...]) -> Image.Image:
    """A square as wide as the image's longer edge, of `fill`, the image in its middle (the
    offset rounded down)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), fill)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The `height` x `width` middle of `pixels` [H, W, C] (its offset rounded down); an image
    smaller than it is first placed in zeros as large as both (its offset rounded up)."""
    h, w = pixels.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + height, left : left + width]
    grown_h, grown_w = max(height, h), max(width, w)
    grown = np.zeros((grown_h, grown_w, *pixels.shape[2:]), dtype=pixels.dtype)
    pad_top, pad_left = math.ceil((grown_h - h) / 2), math.ceil((grown_w - w) / 2)
    grown[pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return grown[
        max(0, top) : min(grown_h, top + height), max(0, left) : min(grown_w, left + width)
    ]


def _processor_type(config: dict[str, Any]) -> str:
    """The processor's class name as transformers' slow-and-fast pairs share it."""
    name = config.get("image_processor_type")
    if name is None:
        name = str(config.get("feature_extractor_type", "")).replace(
            "FeatureExtractor", "ImageProcessor"
        )
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return str(name)


def _resize_of(size: Any) -> tuple[int | None, tuple[int, int] | None]:
    """(shortest edge, None) or (None, (height, width)) from a config's `size`."""
    if isinstance(size, int):
        return size, None
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return int(size["shortest_edge"]), None
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return None, (int(size["height"]), int(size["width"]))
    raise ValueError(f"{PREPROCESSOR_CONFIG}: size {size!r} is not supported")


def _crop_of(crop: Any) -> tuple[int, int]:
    """(height, width) from a config's `crop_size`: a square's side, or both."""
    if isinstance(crop, int):
        return crop, crop
    if isinstance(crop, dict) and set(crop) == {"height", "width"}:
        return int(crop["height"]), int(crop["width"])
    raise ValueError(f"{PREPROCESSOR_CONFIG}: crop_size {crop!r} is not supported")


def _per_channel(values: Any) -> tuple[float, ...]:
    """Three channels' values from one value or a list of three."""
    found = [values] * 3 if isinstance(values, (int, float)) else list(values)
    if len(found) != 3:
        raise ValueError(f"{PREPROCESSOR_CONFIG}: {values!r} is not a value per RGB channel")
    return tuple(float(v) for v in found)
