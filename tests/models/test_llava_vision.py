"""LLaVA's image features (`models.llava.LlavaImageEncoder` over `models.vision`'s towers) equal
transformers' `LlavaForConditionalGeneration.get_image_features` in float32: CLIP and SigLIP
towers, one feature layer or several, either select strategy, one image or several; loaded
through the executor's `WeightReader` from a checkpoint `save_pretrained` wrote (or laid out as
the Hub's checkpoints are), every tensor of the tower and the projector counted read, the layers
past the deepest feature layer never built. And from Pillow images to features, through our
preprocessing, as transformers' processor and model give them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    SiglipVisionConfig,
)

from radixrt.executor.model_loader import WeightReader
from radixrt.models.llava import LlavaImageEncoder
from radixrt.multimodal.processors import ClipImageProcessor

# a 28-pixel image in patches of 7: 16 patches (and CLIP's class token), three layers
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)
TEXT = LlamaConfig(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TOWER_TENSORS = ("vision_tower.", "multi_modal_projector.")


def checkpoint(folder: Path, vision, seed: int = 0, **llava) -> LlavaForConditionalGeneration:
    """A random float32 LLaVA saved in `folder` (transformers' model, to compare with)."""
    config = LlavaConfig(vision_config=vision, text_config=TEXT, image_token_index=127, **llava)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    for p in model.parameters():  # past the initializer's small values, so every part shows
        p.data.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


def load_encoder(folder: Path) -> tuple[LlavaImageEncoder, WeightReader]:
    """Ours, built on the meta device and loaded as the executor loads a model."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        encoder = LlavaImageEncoder(config)
    encoder.to_empty(device="cpu")
    reader = WeightReader(folder)
    try:
        encoder.load_weights(reader)
    finally:
        reader.close()
    return encoder.eval(), reader


def their_features(model: LlavaForConditionalGeneration, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(list(model.get_image_features(pixel_values=pixels).pooler_output))


CASES = {
    "clip, -2, default, one image": (CLIPVisionConfig(**VISION), dict(), 1),
    "clip, -2, full, three images": (
        CLIPVisionConfig(**VISION),
        dict(vision_feature_select_strategy="full"),
        3,
    ),
    "clip, [-3, -1], default": (CLIPVisionConfig(**VISION), dict(vision_feature_layer=[-3, -1]), 2),
    "clip, [0, 2, -2], full, no projector bias, tanh gelu": (
        CLIPVisionConfig(**VISION),
        dict(
            vision_feature_layer=[0, 2, -2],
            vision_feature_select_strategy="full",
            multimodal_projector_bias=False,
            projector_hidden_act="gelu_pytorch_tanh",
        ),
        2,
    ),
    "siglip, -1, full, with its pooling head": (
        SiglipVisionConfig(**VISION),
        dict(vision_feature_layer=-1, vision_feature_select_strategy="full"),
        2,
    ),
    "siglip, [1, -2], default": (
        SiglipVisionConfig(**VISION, vision_use_head=False),
        dict(vision_feature_layer=[1, -2]),
        1,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_features_equal_transformers(tmp_path, case):
    vision, llava, images = CASES[case]
    model = checkpoint(tmp_path, vision, **llava)
    encoder, reader = load_encoder(tmp_path)
    pixels = torch.randn(images, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = encoder(pixels)
    want = their_features(model, pixels)
    assert ours.shape == want.shape == (images, encoder.tokens_per_image, TEXT.hidden_size)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    vision_tensors = {n for n in reader.names if n.startswith(TOWER_TENSORS)}
    assert vision_tensors <= reader.read, sorted(vision_tensors - reader.read)[:4]


def test_only_the_layers_the_features_read_are_built(tmp_path):
    """-2 of three layers: the tower stops after its second; the third layer's tensors are
    counted read but never loaded."""
    checkpoint(tmp_path, CLIPVisionConfig(**VISION))
    encoder, _ = load_encoder(tmp_path)
    assert len(encoder.vision_tower.encoder.layers) == 2 and encoder.wanted == (2,)
    assert encoder.tokens_per_image == 16  # the class token dropped


def test_the_hubs_layout_loads(tmp_path):
    """llava-hf's checkpoints keep the tower under `vision_tower.vision_model.` (transformers 4's
    names; transformers 5 saves `vision_tower.` and reads either)."""
    model = checkpoint(tmp_path, CLIPVisionConfig(**VISION))
    path = tmp_path / "model.safetensors"
    tensors = {
        n.replace("vision_tower.", "vision_tower.vision_model.", 1): t
        for n, t in load_file(path).items()
    }
    save_file(tensors, path, metadata={"format": "pt"})
    encoder, _ = load_encoder(tmp_path)
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(encoder(pixels), their_features(model, pixels))


def test_from_pillow_images_to_features(tmp_path):
    """Images of different sizes through our preprocessing and encoder equal transformers'
    processor and `get_image_features`."""
    model = checkpoint(tmp_path, CLIPVisionConfig(**VISION))
    CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    ).save_pretrained(tmp_path)
    rng = np.random.default_rng(3)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in [(40, 64), (90, 31), (28, 28)]
    ]
    processor = ClipImageProcessor.from_folder(tmp_path)
    pixels = torch.from_numpy(np.stack([processor(image) for image in images]))
    encoder, _ = load_encoder(tmp_path)
    theirs = CLIPImageProcessorPil.from_pretrained(tmp_path)(images=images, return_tensors="pt")
    with torch.no_grad():
        ours = encoder(pixels)
    torch.testing.assert_close(ours, their_features(model, theirs["pixel_values"]))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("vision_feature_layer", -5, "names no hidden state"),
        ("vision_feature_layer", [1, 4], "names no hidden state"),
        ("vision_feature_select_strategy", "cls", "none of"),
        ("projector_hidden_act", "relu6", "not supported"),
    ],
)
def test_what_it_cannot_compute_is_refused(field, value, message):
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=TEXT)
    object.__setattr__(config, field, value)  # past the validation of transformers 5's fields
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        LlavaImageEncoder(config)


def test_another_tower_and_another_image_size_are_refused():
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=TEXT)
    config.vision_config.model_type = "pixtral"
    with torch.device("meta"), pytest.raises(ValueError, match="pixtral"):
        LlavaImageEncoder(config)
    encoder = LlavaImageEncoder(LlavaConfig(vision_config=CLIPVisionConfig(**VISION)))
    with pytest.raises(ValueError, match="28 x 28"):
        encoder(torch.zeros(1, 3, 28, 35))
