"""OpenAI requests honoured or refused field by field (issue 29): completions' `echo` with prompt
logprobs, SGLang's and vLLM's sampling extras, `logit_bias`, unknown fields refused by name, and
the serving names (`--served-model-name`, `--chat-template`, `--tokenizer-path`, a Hub id from
a pre-filled local Hub cache). One runtime, through the `openai` client and raw HTTP."""

from __future__ import annotations

import json
import re
import shutil

import huggingface_hub.constants
import jinja2
import openai
import pytest
import torch

from radixrt.executor.model_loader import hub_snapshot, load_chat_template, resolve_model_path

from helpers import _hf_model, http_json

HUB_ID = "radixrt-tests/tiny-llama"
SERVED = "tiny"
PROMPT = "The capital of France is"
HTTP_TIMEOUT_S = 60.0
# a template that reads a variable only `chat_template_kwargs` sets
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _fill_hub_cache(cache, model_dir) -> None:
    """The layout huggingface_hub keeps a downloaded repository in: refs/main names a snapshot."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(model_dir, repo / "snapshots" / ("0" * 40))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_dir):
    cache = tmp_path_factory.mktemp("hub")
    _fill_hub_cache(cache, tiny_model_dir)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(cache))  # for the runtime's processes
        env.setenv("HF_HUB_OFFLINE", "1")
        # this process imported huggingface_hub already, which read its environment then
        env.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def runtime(runtimes, hub_cache, tiny_model_dir):
    with runtimes.lease(
        HUB_ID,
        http=True,
        served_model_name=SERVED,
        tokenizer_path=str(tiny_model_dir),
        chat_template=TEMPLATE,
        max_total_tokens=4096,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def client(runtime):
    with openai.OpenAI(
        base_url=f"{runtime.http_url}/v1", api_key="-", max_retries=0, timeout=HTTP_TIMEOUT_S
    ) as c:
        yield c


def _greedy_ids(runtime, n: int) -> list[int]:
    """The greedy continuation's token ids, over ZeroMQ (a token's text may not re-encode to it)."""
    return runtime.generate(PROMPT, {"temperature": 0, "max_new_tokens": n})["output_ids"]


def _complete(client, **kwargs):
    return client.completions.create(model=SERVED, prompt=PROMPT, **kwargs)


def test_served_name_hub_id_and_tokenizer_path(runtime, client, tiny_model_dir):
    assert [m.id for m in client.models.list()] == [SERVED]
    assert _complete(client, max_tokens=1).model == SERVED
    info = runtime.model_info
    assert info["tokenizer_path"] == str(tiny_model_dir)
    assert info["model_path"].startswith(str(hub_snapshot(HUB_ID).parent))
    assert info["chat_template"] == TEMPLATE


def test_hub_ids_resolve_only_from_the_cache(hub_cache):
    assert (resolve_model_path(HUB_ID) / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face Hub cache") as e:
        resolve_model_path("radixrt-tests/absent")
    assert "\n" not in str(e.value)


def test_chat_template_file_inline_or_refused(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no/such/file.jinja")
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% if %}")


def test_top_k_1_is_greedy_at_any_temperature(client):
    greedy = _complete(client, max_tokens=8, temperature=0).choices[0].text
    hot = _complete(client, max_tokens=8, temperature=1.8, seed=3, extra_body={"top_k": 1})
    assert hot.choices[0].text == greedy
    chat = client.chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=8, temperature=0
    )
    hot_chat = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=8,
        temperature=1.8,
        seed=3,
        extra_body={"top_k": 1},
    )
    assert hot_chat.choices[0].message.content == chat.choices[0].message.content


def test_logit_bias_forces_and_bans(runtime, client):
    forced = runtime.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    out = _complete(client, max_tokens=4, temperature=1.0, seed=0, logit_bias={str(forced): 100})
    assert out.choices[0].text == runtime.tokenizer.decode([forced] * 4)
    first = _greedy_ids(runtime, 1)[0]
    banned = _complete(client, max_tokens=1, temperature=0, logprobs=1, logit_bias={first: -100})
    assert banned.choices[0].logprobs.tokens != [runtime.tokenizer.decode([first])]


def test_logit_bias_is_checked_against_the_vocabulary(runtime):
    vocab = runtime.model_info["vocab_size"]
    for bias, words in (({str(vocab): 1}, "token ids must be in"), ({"7": 101}, "logit_bias[7]")):
        status, body = http_json(
            f"{runtime.http_url}/v1/completions", {"prompt": PROMPT, "logit_bias": bias}
        )
        assert status == 400 and words in body["error"]["message"], body


def test_min_tokens_and_ignore_eos_hold_off_a_forced_eos(runtime, client):
    eos = str(runtime.model_info["eos_token_ids"][0])
    held = _complete(
        client, max_tokens=12, temperature=0, logit_bias={eos: 100}, extra_body={"min_tokens": 5}
    )
    # five tokens, then the EOS that ends them (counted, as OpenAI and vLLM count it)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    ignored = _complete(
        client,
        max_tokens=6,
        temperature=0,
        logit_bias={eos: 100},
        extra_body={"ignore_eos": True, "min_tokens": 6},
    )
    assert ignored.usage.completion_tokens == 6 and ignored.choices[0].finish_reason == "length"


def test_stop_token_ids_regex_and_skip_special_tokens(runtime, client):
    ids = _greedy_ids(runtime, 6)
    stopped = _complete(
        client, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[2]]}
    )
    assert stopped.usage.completion_tokens == 3 and stopped.choices[0].finish_reason == "stop"
    digits = _complete(
        client, max_tokens=6, temperature=0.7, seed=1, extra_body={"regex": "[0-9]{4}"}
    )
    assert digits.choices[0].text.isdigit() and len(digits.choices[0].text) == 4
    chat = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=20,
        temperature=0,
        extra_body={
            "json_schema": json.dumps(
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            )
        },
    )
    assert isinstance(json.loads(chat.choices[0].message.content)["a"], int)
    im_end = runtime.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept = _complete(
        client,
        max_tokens=2,
        temperature=0,
        logit_bias={str(im_end): 100},
        extra_body={"skip_special_tokens": False, "ignore_eos": True},
    )
    assert kept.choices[0].text == "<|im_end|>" * 2


def test_grammars_as_extra_fields_and_json_object(runtime, client):
    """`ebnf` and `lark` on both endpoints and native /generate; json_object through llguidance;
    a grammar that does not parse is invalid_constraint."""
    sums = _complete(
        client, max_tokens=12, temperature=0, extra_body={"ebnf": 'root ::= [0-9] ("+" [0-9])*'}
    )
    assert re.fullmatch(r"[0-9](\+[0-9])*\+?", sums.choices[0].text), sums.choices[0].text
    pair = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        extra_body={"lark": 'start: "(" /[a-z]/ ")"'},
    )
    assert re.fullmatch(r"\([a-z]\)", pair.choices[0].message.content)
    status, body = http_json(
        f"{runtime.http_url}/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "lark": 'start: "ab"'}},
    )
    assert status == 200 and body["text"] == "ab", body
    obj = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    status, body = http_json(
        f"{runtime.http_url}/v1/completions", {"prompt": PROMPT, "ebnf": "root ::= ("}
    )
    assert status == 400 and body["error"]["code"] == "invalid_constraint", body


def test_a_constraint_from_two_sources_is_refused(runtime):
    status, body = http_json(
        f"{runtime.http_url}/v1/chat/completions",
        {"messages": QUESTION, "regex": "a+", "response_format": {"type": "json_object"}},
    )
    assert status == 400 and body["error"]["param"] == "response_format", body


def test_unknown_fields_are_refused_by_name(runtime, client):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokns": 4}),
        ("/v1/chat/completions", {"messages": QUESTION, "top_kk": 2}),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "response_format": {"type": "text", "strict": 1}},
        ),
    ):
        status, reply = http_json(runtime.http_url + path, body)
        error = reply["error"]
        misspelled = [k for k in ("max_tokns", "top_kk", "strict") if k in json.dumps(body)][0]
        assert status == 400 and error["code"] == "invalid_request", reply
        assert misspelled in error["message"] and misspelled in error["param"], reply
    with pytest.raises(openai.BadRequestError, match="best_of"):
        _complete(client, max_tokens=1, best_of=2)


def test_fields_that_change_nothing_are_accepted(client):
    out = client.chat.completions.create(
        model=SERVED,
        messages=QUESTION,
        max_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
    )
    assert out.choices[0].message.content is not None


def test_chat_template_kwargs_and_continue_final_message(client):
    """The chat endpoint renders with the served template, its variables and vLLM's
    continue_final_message: the same greedy text as a completion of that rendering."""
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE)
    cases = (
        (
            {"chat_template_kwargs": {"greeting": "Bonjour"}},
            QUESTION,
            dict(greeting="Bonjour", add_generation_prompt=True),
        ),
        (
            {"continue_final_message": True},
            [*QUESTION, {"role": "assistant", "content": "It is"}],
            dict(add_generation_prompt=False, continue_final_message=True),
        ),
    )
    for extra, messages, variables in cases:
        chat = client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=6, temperature=0, extra_body=extra
        )
        prompt = template.render(messages=messages, **variables)
        text = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == text.choices[0].text
        assert chat.usage.prompt_tokens == text.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(
            model=SERVED,
            messages=QUESTION,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )


def test_echo_logprobs_equal_transformers(runtime, client, tiny_model_dir):
    ids = runtime.tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.inference_mode():
        logits = _hf_model(str(tiny_model_dir))(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)
    for max_tokens in (0, 2):
        out = _complete(client, max_tokens=max_tokens, temperature=0, echo=True, logprobs=3)
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.tokens[: len(ids)] == [runtime.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1 : len(ids)])
        want = expected[torch.arange(len(ids) - 1), ids[1:]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for pos in range(1, len(ids)):
            top = sorted(lp.top_logprobs[pos].values(), reverse=True)
            torch.testing.assert_close(
                torch.tensor(top), expected[pos - 1].topk(3).values, atol=1e-4, rtol=1e-4
            )
        assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens)


def test_echo_without_logprobs_and_streamed(client):
    whole = _complete(client, max_tokens=4, temperature=0, echo=True)
    plain = _complete(client, max_tokens=4, temperature=0)
    assert whole.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(_complete(client, max_tokens=4, temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    ids = _complete(client, max_tokens=0, echo=True)
    assert ids.choices[0].text == PROMPT and ids.usage.completion_tokens == 0


def test_echo_logprobs_equal_native_generates(runtime, client):
    """One prompt scored two ways: completions' echo and native /generate's
    `input_token_logprobs` give the same list: every prompt token, the first's logprob None."""
    ids = runtime.tokenizer.encode(PROMPT, add_special_tokens=False)
    echoed = _complete(client, max_tokens=0, echo=True, logprobs=1).choices[0].logprobs
    status, native = http_json(
        f"{runtime.http_url}/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, native
    entries = native["meta_info"]["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == ids and len(echoed.token_logprobs) == len(ids)
    assert entries[0][0] is None and echoed.token_logprobs[0] is None
    scored = [(lp, tok) for lp, tok, _ in entries[1:]]
    torch.testing.assert_close(
        torch.tensor(echoed.token_logprobs[1 : len(ids)]),
        torch.tensor([lp for lp, _ in scored]),
        atol=1e-5,
        rtol=1e-5,
    )
