"""A chat route on a model without a chat template refuses by name (no null code), and one
tokenization for every route: a model whose tokenizer asks for a BOS (as a GGUF's
`tokenizer.ggml.add_bos_token` does, as Gemma's and Llama's do) gets it on `/generate`,
`/v1/completions`, `/tokenize`, ZeroMQ and DSL `select`, exactly once; a chat template that
writes `{{ bos_token }}` itself gives one BOS, not two (transformers' `apply_chat_template`)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

import radixrt as rt

from helpers import http_json
from timeouts import REPLY_TIMEOUT_S

PROMPT = "The capital of France is"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONE = {"max_new_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its tokenizer adding a BOS (a post-processor that puts it first, as
    Llama 3's tokenizer.json has), its chat template writing one."""
    folder = tmp_path_factory.mktemp("tiny-bos")
    for path in tiny_model_dir.iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    bos = config["bos_token"]
    files = json.loads((folder / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in files["added_tokens"] if t["content"] == bos)
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    files["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            first,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(files))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def runtime(runtimes, bos_model_dir):
    with runtimes.lease(bos_model_dir, http=True, max_total_tokens=2048) as r:
        yield r


@pytest.fixture(scope="module")
def tokenizer(bos_model_dir):
    return AutoTokenizer.from_pretrained(bos_model_dir)


def test_every_route_gives_a_text_prompt_one_bos(runtime, tokenizer):
    bos = tokenizer.bos_token_id
    want = tokenizer.encode(PROMPT)
    assert want[0] == bos and want[1] != bos
    url = runtime.http_url
    assert http_json(f"{url}/tokenize", {"prompt": PROMPT})[1]["tokens"] == want
    status, body = http_json(f"{url}/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert body["tokens"] == want[1:]
    status, body = http_json(f"{url}/generate", {"text": PROMPT, "sampling_params": ONE})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == len(want)
    completion = {"model": "default", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    status, body = http_json(f"{url}/v1/completions", completion)
    assert status == 200 and body["usage"]["prompt_tokens"] == len(want)
    # a text that already starts with the BOS gets no second one
    status, body = http_json(f"{url}/tokenize", {"prompt": tokenizer.bos_token + PROMPT})
    assert body["tokens"] == want
    zmq = rt.RuntimeEndpoint(runtime.url, timeout=REPLY_TIMEOUT_S)
    try:
        assert zmq.generate(PROMPT, ONE)["meta_info"]["prompt_tokens"] == len(want)
        assert zmq.tokenize(PROMPT, add_special_tokens=True) == want
        assert zmq.tokenize(PROMPT) == want[1:]  # a fragment's own tokens (stop tokens, choices)
    finally:
        zmq.close()


def test_a_template_that_writes_the_bos_gets_one(runtime, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tokenizer.encode(text, add_special_tokens=False)  # what tokenize=True gives
    assert want[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")]
    body = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0}
    status, reply = http_json(f"{runtime.http_url}/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(want)


@pytest.fixture(scope="module")
def templateless_runtime(runtimes, tiny_model_dir, tmp_path_factory):
    """The tiny model with no chat template anywhere in its files (as many base GGUFs)."""
    folder = tmp_path_factory.mktemp("tiny-no-template")
    for path in tiny_model_dir.iterdir():
        if path.name != "chat_template.jinja":
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with runtimes.lease(folder, http=True, max_total_tokens=2048) as r:
        yield r


def test_chat_without_a_template_is_refused_naming_the_flag(templateless_runtime):
    url = templateless_runtime.http_url
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    status, body = http_json(f"{url}/v1/chat/completions", chat)
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert "--chat-template" in body["error"]["message"]
    anthropic = {"model": "default", "max_tokens": 1, "messages": chat["messages"]}
    status, body = http_json(f"{url}/v1/messages", anthropic)
    assert status == 400 and "--chat-template" in json.dumps(body)
    completion = {"model": "default", "prompt": "Hi", "max_tokens": 1}
    assert http_json(f"{url}/v1/completions", completion)[0] == 200  # text prompts still serve
