"""`--is-embedding` and `POST /v1/embeddings`: the default model's vectors through the official
`openai` SDK equal transformers' (last-token pooling of the final hidden states, normalized), from
a cold or a warm cache; a base-model checkpoint with sentence-transformers' mean pooling, read in
prefill chunks; `dimensions`, token-id inputs and the refusals on both kinds of server."""

from __future__ import annotations

import json

import pytest
import torch

from radixrt.models.pooling import Pooling
from radixrt.server.http.openai_embeddings import _size

from helpers import http_json, launch_runtime

TEXTS = [
    "The capital of France is Paris.",
    "A shared preamble about cats and their habits. " * 4 + "Do cats like water?",
    "A shared preamble about cats and their habits. " * 4 + "Do cats sleep a lot?",
]


@pytest.fixture(scope="module")
def embedding_runtime(runtimes, default_model_dir):
    with runtimes.lease(default_model_dir, http=True, is_embedding=True) as r:
        yield r


def reference(folder, texts: list[str], mode: str = "last") -> torch.Tensor:
    """transformers' final hidden states of each text, pooled and normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        rows.append(hidden[-1] if mode == "last" else hidden.mean(0))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_the_openai_sdk_gets_transformers_vectors(embedding_runtime, default_model_dir):
    import openai

    expected = reference(default_model_dir, TEXTS)
    url = f"{embedding_runtime.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0) as client:
        as_base64 = client.embeddings.create(model="default", input=TEXTS)  # the SDK's default
        as_floats = client.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    for reply in (as_base64, as_floats):
        got = torch.tensor([d.embedding for d in sorted(reply.data, key=lambda d: d.index)])
        assert got.shape == expected.shape
        assert (got - expected).abs().max() < 1e-5
        assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    # the third text's preamble came from the cache of the second
    again = embedding_runtime.encode(TEXTS[2])
    assert again["meta_info"]["cached_tokens"] > 20
    assert (torch.tensor(again["embedding"]) - expected[2]).abs().max() < 1e-5


def test_token_ids_in_and_refusals_out(embedding_runtime, default_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(TEXTS[0])
    url = embedding_runtime.http_url + "/v1/embeddings"
    _, by_ids = http_json(url, {"input": ids, "encoding_format": "float"})
    _, by_text = http_json(url, {"input": TEXTS[0], "encoding_format": "float"})
    assert by_ids["data"][0]["embedding"] == by_text["data"][0]["embedding"]
    status, cut = http_json(url, {"input": "x", "dimensions": 8})
    assert status == 400 and cut["error"]["param"] == "dimensions"
    status, unknown = http_json(url, {"input": "x", "temperature": 0})
    assert status == 400 and "temperature" in unknown["error"]["message"]
    assert http_json(url, {"input": [""]})[0] == 400
    status, chat = http_json(
        embedding_runtime.http_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 400 and "--is-embedding" in chat["error"]["message"]
    assert http_json(url, {"input": "still serving"})[0] == 200


def test_a_generation_server_refuses_embeddings_by_name(tiny_runtime):
    status, reply = http_json(f"{tiny_runtime.http_url}/v1/embeddings", {"input": "x"})
    assert status == 400 and "--is-embedding" in reply["error"]["message"]


def test_a_base_checkpoint_with_mean_pooling_read_in_chunks(tmp_path, tiny_model_dir):
    """A `LlamaModel` checkpoint (no `model.` prefix, no lm_head), with sentence-transformers'
    files asking for mean pooling and no Normalize: every prompt position counts once though
    the prompt arrives in 16-token chunks and shares a cached prefix."""
    from transformers import AutoConfig, LlamaModel

    config = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    LlamaModel(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    pooling = Pooling.of_model(tmp_path, config)
    assert (pooling.mode, pooling.normalize) == ("mean", False)
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with launch_runtime(tmp_path, is_embedding=True, chunked_prefill_size=16) as r:
        for text in TEXTS[1:]:
            with torch.no_grad():
                hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            got = torch.tensor(r.encode(text)["embedding"])
            assert (got - hidden.mean(0)).abs().max() < 1e-5


def test_dimensions_follow_the_models_matryoshka_sizes():
    fixed = {"size": 64, "matryoshka": [16, 32], "normalize": True}
    assert _size(fixed, None) == 64 and _size(fixed, 32) == 32
    free = {"size": 64, "matryoshka": [], "normalize": True}
    assert _size(free, 7) == 7
    for pooling, dims in ((fixed, 8), (free, 65), ({**fixed, "matryoshka": None}, 16)):
        with pytest.raises(Exception, match="dimensions"):
            _size(pooling, dims)
