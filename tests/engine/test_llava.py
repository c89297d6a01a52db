"""LLaVA served in-process (`models.llava.LlavaForConditionalGeneration`): greedy tokens equal
transformers' `LlavaForConditionalGeneration.generate` in float32 with the same images (made
with Pillow here, preprocessed by transformers' processor for the reference and by ours in the
runtime), for one image and for two in one prompt, cold and warm, chunked, and beside a
text-only request in one batch. The radix tree keys an image's placeholders by its content: a
resent image is served from the tree past it and not encoded again; another image after the
same text shares the text only. Images a model cannot take, or that do not match the prompt's
placeholders, are refused."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from radixrt.config import ImageSettings
from radixrt.engine.images import pseudo_id
from radixrt.multimodal.images import DecodedImage, load_image
from radixrt.sampling_params import SamplingParams

from helpers import TINY, drain, make_scheduler
from ownership import assert_no_leak

MAX_NEW = 8
IMAGE_TOKEN = 49151  # the tokenizer's last id stands for `<image>`
PER_IMAGE = 16  # 28-pixel images in patches of 7, the class token dropped
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)
PARAMS = SamplingParams.from_dict({"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
BEFORE, AFTER = [1, 415, 2717, 314, 1056, 42], [1372, 28, 604, 3542, 31, 216]


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB picture of `size` (width, height) as PNG bytes."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


IMAGES = [png(1, (40, 64)), png(2, (90, 31)), png(3, (28, 28))]


def random_llava(folder, seed: int) -> LlavaForConditionalGeneration:
    """A tiny random LLaVA (CLIP tower, Llama text model of the tests' shape) saved in
    `folder`: transformers' model, to compare with."""
    text = LlamaConfig(**TINY, max_position_embeddings=1024)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION), text_config=text, image_token_index=IMAGE_TOKEN
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    for name, p in model.named_parameters():  # the tower past its initializer's small values
        if "language_model" not in name:
            p.data.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tiny_model_dir):
    """`random_llava` with the default model's tokenizer and its processor's config;
    transformers' model and processor."""
    folder = tmp_path_factory.mktemp("tiny-llava")
    model = random_llava(folder, 0)
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    processor.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    return folder, model, processor


def expanded(ids: list[int]) -> list[int]:
    """`ids` with each image token expanded as transformers' `LlavaProcessor` does."""
    return [t for i in ids for t in ([i] * PER_IMAGE if i == IMAGE_TOKEN else [i])]


def reference(llava, ids: list[int], images: list[bytes]) -> list[int]:
    """transformers' greedy continuation of `ids` (one image token per image) with `images`."""
    _, model, processor = llava
    prompt = torch.tensor([expanded(ids)])
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    if images:
        pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        inputs["pixel_values"] = processor(images=pictures, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


def decoded(images: list[bytes]) -> list[DecodedImage]:
    return [load_image(b, ImageSettings(), i) for i, b in enumerate(images)]


def serve(scheduler, prompts: list[tuple[list[int], list[bytes]]], tag: str) -> list:
    """Every (ids, images) prompt at once; the finished requests, in order."""
    reqs = [
        scheduler.make_request(f"{tag}{i}", ids, PARAMS, images=decoded(images))
        for i, (ids, images) in enumerate(prompts)
    ]
    for req in reqs:
        scheduler.add_request(req)
    drain(scheduler)
    return reqs


def test_one_image_cold_then_warm_from_the_tree(llava):
    """The resent prompt is served from the tree past its image, which is not encoded again;
    `stats` counts its placeholders among the cached tokens."""
    ids = BEFORE + [IMAGE_TOKEN] + AFTER
    want = reference(llava, ids, IMAGES[:1])
    scheduler = make_scheduler(llava[0])
    (cold,) = serve(scheduler, [(ids, IMAGES[:1])], "cold")
    assert cold.output_ids == want
    assert cold.meta_info()["prompt_tokens"] == len(BEFORE) + PER_IMAGE + len(AFTER)
    (warm,) = serve(scheduler, [(ids, IMAGES[:1])], "warm")
    assert warm.output_ids == want
    assert warm.cached_tokens == len(expanded(ids)) - 1  # all but the last prompt token
    stats = scheduler.stats()
    assert stats["image_encoder_calls"] == 1
    assert stats["image_tokens_total"] == 2 * PER_IMAGE
    assert stats["cached_image_tokens_total"] == PER_IMAGE
    assert_no_leak(scheduler)


def test_two_images_in_one_prompt_already_expanded(llava):
    """Two images, the prompt's placeholders given expanded (as transformers' processor writes
    them): each image's features fill its own run."""
    ids = BEFORE + [IMAGE_TOKEN] + AFTER[:3] + [IMAGE_TOKEN] + AFTER[3:]
    want = reference(llava, ids, IMAGES[:2])
    scheduler = make_scheduler(llava[0])
    (req,) = serve(scheduler, [(expanded(ids), IMAGES[:2])], "two")
    assert req.output_ids == want
    assert scheduler.stats()["image_encoder_calls"] == 2
    assert_no_leak(scheduler)


def test_another_image_after_the_same_text_shares_the_text_only(llava):
    """The tree holds the first image's KV; a second image after the same text is matched up
    to its first placeholder, and its answer is its own."""
    ids = BEFORE + [IMAGE_TOKEN] + AFTER
    scheduler = make_scheduler(llava[0])
    serve(scheduler, [(ids, IMAGES[:1])], "first")
    (other,) = serve(scheduler, [(ids, IMAGES[2:3])], "other")
    assert other.output_ids == reference(llava, ids, IMAGES[2:3])
    assert other.cached_tokens == len(BEFORE)
    assert scheduler.stats()["image_encoder_calls"] == 2
    start = len(BEFORE)
    preprocessing = scheduler.runner.image_features.preprocessing
    first, second = (
        pseudo_id(load_image(b, ImageSettings()).key, preprocessing, TINY["vocab_size"])
        for b in (IMAGES[0], IMAGES[2])
    )
    assert first != second and first >= TINY["vocab_size"]
    assert other.all_ids[start : start + PER_IMAGE] == [second] * PER_IMAGE
    assert other.input_ids[start : start + PER_IMAGE] == [IMAGE_TOKEN] * PER_IMAGE
    assert_no_leak(scheduler)


def test_chunked_prefill_and_a_text_only_request_in_the_batch(llava):
    """Chunks of 5 tokens cut each image's run of 16 into parts, each step taking its rows of
    the features; a text-only request runs in the same batches. Warm, the chunks resume past
    the cached image."""
    image = BEFORE + [IMAGE_TOKEN] + AFTER[:2] + [IMAGE_TOKEN] + AFTER[2:]
    text = BEFORE + AFTER + AFTER
    want = [reference(llava, image, IMAGES[1:3]), reference(llava, text, [])]
    scheduler = make_scheduler(llava[0], chunked_prefill_size=5, max_prefill_tokens=24)
    for tag in ("cold", "warm"):
        reqs = serve(scheduler, [(image, IMAGES[1:3]), (text, [])], tag)
        assert [r.output_ids for r in reqs] == want, tag
    assert reqs[0].cached_tokens == len(expanded(image)) - 1  # all but the last prompt token
    assert scheduler.stats()["image_encoder_calls"] == 2
    assert_no_leak(scheduler)


def test_new_weights_encode_the_image_again(llava, tmp_path):
    """A weight update serves the new tower and projector (`adopt_image_encoder`) and forgets
    the features the old ones made."""
    ids = BEFORE + [IMAGE_TOKEN] + AFTER
    scheduler = make_scheduler(llava[0])
    serve(scheduler, [(ids, IMAGES[:1])], "old")
    trained = random_llava(tmp_path, 1)
    scheduler.update_weights(tmp_path, True, None)
    (req,) = serve(scheduler, [(ids, IMAGES[:1])], "new")
    assert req.output_ids == reference((None, trained, llava[2]), ids, IMAGES[:1])
    assert req.cached_tokens == 0 and scheduler.stats()["image_encoder_calls"] == 2
    assert_no_leak(scheduler)


def test_images_that_do_not_fit_the_prompt_or_the_model_are_refused(llava, tiny_model_dir):
    scheduler = make_scheduler(llava[0])
    one = decoded(IMAGES[:1])
    with pytest.raises(ValueError, match="1 images but 2 image tokens"):
        scheduler.make_request("r", BEFORE + [IMAGE_TOKEN, IMAGE_TOKEN], PARAMS, images=one)
    with pytest.raises(ValueError, match="0 images but 1 image tokens"):
        scheduler.make_request("r", BEFORE + [IMAGE_TOKEN], PARAMS)
    split = BEFORE + [IMAGE_TOKEN] * 8 + AFTER + [IMAGE_TOKEN] * 8
    with pytest.raises(ValueError, match="must be one run"):
        scheduler.make_request("r", split, PARAMS, images=one)
    text_model = make_scheduler(tiny_model_dir)
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no images"):
        text_model.make_request("r", BEFORE + [IMAGE_TOKEN], PARAMS, images=one)
