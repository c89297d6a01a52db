"""The CLIP family's preprocessing (`multimodal.processors`) gives transformers' own slow
processors' pixel values bit for bit: CLIP's, LLaVA's (padded to a square), SigLIP's and an older
config's int sizes, over Pillow-made images of several sizes, aspect ratios and modes (with
an alpha band, grey, a palette with and without a transparent colour), including images smaller than the crop."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from transformers import (
    AutoImageProcessor,
    CLIPImageProcessorPil,
    LlavaImageProcessorPil,
    SiglipImageProcessorPil,
)

from radixrt.multimodal.processors import ClipImageProcessor


def made_images() -> list[Image.Image]:
    """Noise and gradients of several sizes (wide, tall, square, tiny) and modes."""
    rng = np.random.default_rng(5)
    shapes = [(30, 40), (61, 17), (28, 28), (200, 300), (9, 12), (31, 29)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    y, x = np.mgrid[0:45, 0:70]
    gradient = np.stack([x * 255 // 69, y * 255 // 44, (x + y) % 256], -1).astype(np.uint8)
    images.append(Image.fromarray(gradient))
    images.append(Image.fromarray(rng.integers(0, 256, (33, 50, 4), dtype=np.uint8)))  # RGBA
    images.append(Image.fromarray(gradient[..., 0]))  # grey (L)
    palette = images[0].convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    images.append(palette)
    clear = palette.copy()
    clear.info["transparency"] = 3  # a palette's transparent colour
    images.append(clear)
    return images


PROCESSORS = {
    "clip": CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    ),
    "clip-crop-past-resize": CLIPImageProcessorPil(
        size={"shortest_edge": 20}, crop_size={"height": 24, "width": 26}
    ),
    "llava-square": LlavaImageProcessorPil(
        do_pad=True, size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ),
    "siglip": SiglipImageProcessorPil(size={"height": 30, "width": 24}),
    "clip-no-rescale": CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, do_rescale=False
    ),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixel_values_equal_transformers(tmp_path, name):
    PROCESSORS[name].save_pretrained(tmp_path)
    assert_same_pixels(tmp_path)


def test_an_older_configs_int_sizes_and_feature_extractor_type(tmp_path):
    """openai/clip-vit-large-patch14-336's form: `size` and `crop_size` ints, no
    `image_processor_type`."""
    config = {
        "feature_extractor_type": "CLIPFeatureExtractor",
        "size": 26,
        "crop_size": 22,
        "resample": 3,
        "do_resize": True,
        "do_center_crop": True,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    assert_same_pixels(tmp_path)


def assert_same_pixels(folder) -> None:
    theirs = AutoImageProcessor.from_pretrained(folder, backend="pil")
    ours = ClipImageProcessor.from_folder(folder)
    for image in made_images():
        want = theirs(images=image, return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == want.shape, (image.size, image.mode)
        assert np.array_equal(got, want), (image.size, image.mode, np.abs(got - want).max())


@pytest.mark.parametrize(
    "config, message",
    [
        ({"image_processor_type": "Qwen2VLImageProcessor"}, "not supported"),
        ({"image_processor_type": "CLIPImageProcessor", "do_pad": True}, "do_pad"),
        ({"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 9}}, "size"),
        ({"image_processor_type": "CLIPImageProcessor", "image_mean": [0.5, 0.5]}, "per RGB"),
    ],
)
def test_what_it_cannot_do_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        ClipImageProcessor.from_config(config)


def test_a_config_past_its_bound_is_refused_unread(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="past the"):
        ClipImageProcessor.from_folder(tmp_path)
