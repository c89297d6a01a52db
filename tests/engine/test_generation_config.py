"""generation_config.json's sampling defaults: a request's unset parameters take them
(request > generation_config > radixrt's own), as vLLM's `--generation-config auto`."""

from __future__ import annotations

import json
import shutil

import pytest

import radixrt as rt
from radixrt.sampling_params import SamplingParams, generation_defaults

from timeouts import REPLY_TIMEOUT_S


def test_only_the_sampling_fields_it_sets_are_read():
    config = {"temperature": 0.6, "top_k": 0, "top_p": None, "do_sample": False, "eos_token_id": 2}
    assert generation_defaults(config) == {"temperature": 0.6, "top_k": -1}
    assert generation_defaults({"bos_token_id": 1}) == {}


def test_a_request_overrides_the_defaults_field_by_field():
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}
    params = SamplingParams.from_dict({"temperature": 0, "n": 2}, defaults)
    assert (params.temperature, params.top_p, params.max_new_tokens, params.n) == (0, 0.9, 7, 2)
    assert SamplingParams.from_dict(None, {}).temperature == SamplingParams().temperature


def test_invalid_defaults_name_the_file_and_the_way_out():
    with pytest.raises(ValueError, match="generation_config.json: top_p.*--generation-config"):
        generation_defaults({"top_p": 1.5})


def test_the_runtime_applies_the_models_defaults(tmp_path, tiny_model_dir):
    """A folder whose generation_config.json asks for greedy decoding and 3 tokens: a request
    with no parameters gets 3 greedy tokens; `model_info` reports the defaults; with
    `--generation-config ignore` radixrt's own default length applies."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    generation = {"temperature": 0.0, "max_new_tokens": 3, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    prompt = [1, 2, 3, 4, 5]
    greedy = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    kwargs = dict(model=str(folder), max_total_tokens=1024, log_level="warning")
    with rt.Engine(**kwargs, timeout=REPLY_TIMEOUT_S) as engine:
        assert engine.model_info["sampling_defaults"] == {"temperature": 0.0, "max_new_tokens": 3}
        unset = engine.generate(input_ids=prompt, sampling_params={"ignore_eos": True})
        explicit = engine.generate(input_ids=prompt, sampling_params=greedy)
    assert unset["output_ids"] == explicit["output_ids"] and len(unset["output_ids"]) == 3
    with rt.Engine(**kwargs, generation_config="ignore", timeout=REPLY_TIMEOUT_S) as engine:
        assert engine.model_info["sampling_defaults"] == {}
        out = engine.generate(input_ids=prompt, sampling_params={"ignore_eos": True})
    assert len(out["output_ids"]) == SamplingParams().max_new_tokens
