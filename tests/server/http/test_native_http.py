"""SGLang's native HTTP API on `--port`, and `rt.RuntimeEndpoint("http://...")` running DSL
programs over it, against a real runtime and gateway (the tiny random model)."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest
import torch

import radixrt as rt
from radixrt.engine.scheduler import INITIAL_WEIGHT_VERSION

from helpers import _hf_model, http_json
from timeouts import REPLY_TIMEOUT_S

ADMIN, ALICE, BOB = "admin-key", "alice-key", "bob-key"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        api_key_file=str(key_file),
        admin_api_key=ADMIN,
        max_total_tokens=4096,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def http(runtime):
    """The same runtime through its HTTP API, as a tenant with the admin's key for control."""
    return rt.RuntimeEndpoint(
        runtime.http_url, api_key=ALICE, admin_api_key=ADMIN, timeout=REPLY_TIMEOUT_S
    )


def _call(runtime, path: str, body: dict | None = None, key: str = ALICE):
    """(status, parsed body) of one call; an error status is returned, not raised."""
    return http_json(f"{runtime.http_url}{path}", body, key=key)


def _events(runtime, body: dict) -> list:
    request = urllib.request.Request(
        f"{runtime.http_url}/generate",
        json.dumps({**body, "stream": True}).encode(),
        {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
        lines = [line.decode().strip() for line in reply if line.strip()]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_ports_and_urls(runtime):
    assert runtime.http_url == f"http://127.0.0.1:{runtime.args.port}"
    assert runtime.zmq_url == runtime.url == f"tcp://127.0.0.1:{runtime.args.zmq_port}"
    assert rt.ServerArgs(port=30000).endpoint == "tcp://127.0.0.1:30001"
    assert isinstance(rt.RuntimeEndpoint(runtime.http_url), rt.RuntimeEndpoint)


def test_generate_equals_the_zmq_generate(runtime):
    status, body = _call(runtime, "/generate", {"text": PROMPT, "sampling_params": GREEDY})
    assert status == 200
    zmq = runtime.generate(PROMPT, GREEDY)
    assert body["text"] == zmq["text"] and body["output_ids"] == zmq["output_ids"]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == zmq["meta_info"]["prompt_tokens"] and meta["id"]


def test_a_batch_with_one_sampling_params_each(runtime):
    ids = [[5, 6, 7], [8, 9]]
    params = [GREEDY, {**GREEDY, "max_new_tokens": 3}]
    status, bodies = _call(
        runtime, "/generate", {"input_ids": ids, "sampling_params": params, "rid": ["a", "b"]}
    )
    assert status == 200 and [b["meta_info"]["id"] for b in bodies] == ["a", "b"]
    zmq = runtime.generate(input_ids=ids, sampling_params=params)
    assert [b["output_ids"] for b in bodies] == [z["output_ids"] for z in zmq]
    assert len(bodies[1]["output_ids"]) == 3


def test_streaming_is_cumulative_sse(runtime):
    events = _events(runtime, {"text": PROMPT, "sampling_params": GREEDY})
    final = runtime.generate(PROMPT, GREEDY)
    assert events[-1]["text"] == final["text"]
    assert events[-1]["output_ids"] == final["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    growing = [e["output_ids"] for e in events[:-1]]
    assert growing and all(a == b[: len(a)] for a, b in zip(growing, growing[1:]))
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_input_token_logprobs_equal_transformers(runtime, tiny_model_dir):
    ids = [1, 15, 27, 300, 41, 9]
    status, body = _call(
        runtime,
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    )
    assert status == 200
    meta = body["meta_info"]
    with torch.inference_mode():
        logits = _hf_model(str(tiny_model_dir))(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor([ids[1:]]).T)
    # SGLang's: every prompt token from logprob_start_len, the first's logprob null
    assert meta["input_token_logprobs"][0] == [None, ids[0], None]
    assert meta["input_top_logprobs"][0] is None
    scored = meta["input_token_logprobs"][1:]
    assert len(scored) == len(ids) - 1 and all(entry[0] is not None for entry in scored)
    assert [entry[1] for entry in scored] == ids[-len(scored) :]
    got = torch.tensor([entry[0] for entry in scored])
    torch.testing.assert_close(got, expected[-len(scored) :, 0], atol=1e-4, rtol=1e-4)
    assert all(len(entry) == 3 for entry in meta["input_token_logprobs"])  # SGLang's triples
    assert len(meta["output_top_logprobs"][0]) == 2


def test_control_routes(runtime):
    status, info = _call(runtime, "/get_model_info")
    assert status == 200 and info["model_path"] and info["is_generation"] is True
    status, server = _call(runtime, "/get_server_info")
    assert status == 200 and "free_tokens" in server["internal_states"][0]
    assert _call(runtime, "/health")[0] == 200
    assert _call(runtime, "/health_generate")[0] == 200
    status, tokens = _call(runtime, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and tokens["tokens"] == runtime.tokenize(PROMPT)
    assert tokens["count"] == len(tokens["tokens"])
    status, text = _call(runtime, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["text"] == PROMPT


def test_sglangs_routes_and_keys(runtime):
    """What SGLang's frontend and clients call besides /generate: /server_info (its newer
    name), /get_model_info's keys, and /concate_and_append_request, which succeeds doing
    nothing (the frontend appended the branches' text itself)."""
    status, info = _call(runtime, "/get_model_info")
    assert status == 200 and info["tokenizer_path"] == info["model_path"]
    assert info["has_image_understanding"] is False
    assert info["weight_version"] == INITIAL_WEIGHT_VERSION  # the runtime's, no update yet
    status, server = _call(runtime, "/server_info")
    assert status == 200 and server == {**server, "version": rt.__version__}
    body = {"src_rids": ["a", "b"], "dst_rid": "c"}
    assert _call(runtime, "/concate_and_append_request", body) == (200, {"success": True})
    status, models = _call(runtime, "/v1/models")
    assert status == 200 and models["data"]


@pytest.mark.parametrize("field", ["image_data", "input_embeds", "custom_logit_processor"])
def test_unserved_generate_fields_are_refused_saying_why(runtime, field):
    status, body = _call(runtime, "/generate", {"text": PROMPT, field: "x"})
    assert status == 400 and f"{field} is not supported: radixrt" in body["error"]["message"]


def _greedy_text(runtime, **params) -> tuple[str, dict]:
    status, body = _call(
        runtime, "/generate", {"text": PROMPT, "sampling_params": {**GREEDY, **params}}
    )
    assert status == 200, body
    return body["text"], body["meta_info"]


def test_stop_regex_ends_the_text_at_its_first_match(runtime):
    free, _ = _greedy_text(runtime, max_new_tokens=24)
    pattern = "." + re.escape(free[9:11])  # fixed length: the earliest match is the leftmost
    start = re.search(pattern, free, re.DOTALL).start()
    text, meta = _greedy_text(runtime, max_new_tokens=24, stop_regex=pattern)
    assert text == free[:start]
    assert meta["finish_reason"] == {"type": "stop", "matched": pattern}
    kept, _ = _greedy_text(runtime, max_new_tokens=24, stop_regex=[pattern], no_stop_trim=True)
    assert kept == free[: start + 3]
    status, body = _call(
        runtime, "/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "(a"}}
    )
    assert status == 400 and "stop_regex" in body["error"]["message"]


def test_no_stop_trim_keeps_the_stop_string(runtime):
    free, _ = _greedy_text(runtime, max_new_tokens=24)
    stop = free[8:11]
    start = free.index(stop)
    assert _greedy_text(runtime, max_new_tokens=24, stop=stop)[0] == free[:start]
    assert (
        _greedy_text(runtime, max_new_tokens=24, stop=stop, no_stop_trim=True)[0]
        == free[: start + 3]
    )


def test_sampling_seed_is_seed(runtime):
    sampled = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 12}
    by_name = [_greedy_text(runtime, **sampled, sampling_seed=7)[0] for _ in range(2)]
    assert by_name[0] == by_name[1] == _greedy_text(runtime, **sampled, seed=7)[0]
    assert by_name[0] != _greedy_text(runtime, **sampled, sampling_seed=8)[0]


def test_sglangs_null_and_unservable_parameters(runtime):
    """SGLang's clients send every parameter: null lists are none, `custom_params` is refused
    by name unless null, and `spaces_between_special_tokens` reaches the tokenizer (a fast one,
    as here and in SGLang, has no such option: the text is the same)."""
    plain, _ = _greedy_text(runtime)
    nulls = {"stop": None, "stop_token_ids": None, "stop_regex": None, "custom_params": None}
    assert _greedy_text(runtime, **nulls)[0] == plain
    spaced = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert _greedy_text(runtime, **spaced)[0] == _greedy_text(runtime, skip_special_tokens=False)[0]
    status, body = _call(
        runtime, "/generate", {"text": PROMPT, "sampling_params": {"custom_params": {"a": 1}}}
    )
    assert status == 400 and "custom_params is not supported" in body["error"]["message"]


def test_return_text_in_logprobs(runtime):
    status, body = _call(
        runtime,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    )
    assert status == 200
    meta = body["meta_info"]
    decode = runtime.tokenizer.decode
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert all(text == decode([tid]) for _, tid, text in meta[key])
    assert all(text == decode([tid]) for top in meta["output_top_logprobs"] for _, tid, text in top)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2


def test_structural_tag_constrains_the_tagged_segment(runtime):
    """SGLang's structural_tag: free text, but once a trigger appears its structure's `begin`,
    schema and `end` follow. The trigger is two characters the free text has (followed there
    by something else): under the tag, each occurrence goes on as the tag says."""
    free, _ = _greedy_text(runtime, max_new_tokens=24)
    at = next(i for i in range(4, len(free) - 2) if free[i : i + 2].isalpha())
    trigger = free[at : at + 2]
    tag = {
        "structures": [{"begin": trigger + "=>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": [trigger],
    }
    text, _ = _greedy_text(runtime, max_new_tokens=24, structural_tag=json.dumps(tag))
    after = [text[i + 2 :] for i in range(len(text) - 1) if text.startswith(trigger, i)]
    assert all(re.match(r"=?$|=>-?\d*(</f>|</?f?$|$)", rest) for rest in after), text
    assert not all(
        free[i + 2 :].startswith("=>") for i in range(len(free)) if free.startswith(trigger, i)
    )
    status, body = _call(
        runtime,
        "/generate",
        {"text": PROMPT, "sampling_params": {"structural_tag": {"structures": []}}},
    )
    assert status == 400 and "structural_tag" in body["error"]["message"]


def test_flush_cache_needs_the_admin_key(runtime):
    assert _call(runtime, "/flush_cache", {}, key=ALICE)[0] == 401
    assert _call(runtime, "/flush_cache", {}, key="wrong")[0] == 401
    status, body = _call(runtime, "/flush_cache", {}, key=ADMIN)
    assert status == 200 and body["success"] is True


def test_abort_request_ends_the_callers_request_only(runtime):
    long = {"max_new_tokens": 100000, "ignore_eos": True, "temperature": 0}
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(
            out=_call(runtime, "/generate", {"text": PROMPT, "sampling_params": long, "rid": "x"})
        )
    )
    thread.start()
    while not runtime.stats()["running"]:
        assert thread.is_alive()
    assert _call(runtime, "/abort_request", {"rid": "x"}, key=BOB)[0] == 404  # alice's rid
    assert _call(runtime, "/abort_request", {"rid": "x"})[0] == 200
    thread.join(REPLY_TIMEOUT_S)
    status, body = result["out"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert _call(runtime, "/abort_request", {"rid": "x"})[0] == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": PROMPT, "sampling_param": GREEDY}, "sampling_param"),
        ({"text": PROMPT, "sampling_params": {"max_new_token": 4}}, "max_new_token"),
        ({"text": PROMPT, "return_logprobs": True}, "return_logprobs"),
    ],
)
def test_a_misspelled_field_is_a_400_naming_it(runtime, body, field):
    status, answer = _call(runtime, "/generate", body)
    assert status == 400 and field in answer["error"]["message"]
    assert _call(runtime, "/generate", {"text": PROMPT, "sampling_params": GREEDY})[0] == 200


@rt.function
def program(s, question):
    s += rt.system("You are terse.")
    s += rt.user(question)
    s += rt.assistant(rt.gen("answer", max_tokens=6, temperature=0))
    s += rt.user("Yes or no?")
    s += rt.assistant(rt.select("verdict", choices=["yes", "no", "maybe"]))
    forks = s.fork(2)
    forks += lambda i: f" Idea {i}:" + rt.gen("idea", max_tokens=4, temperature=0, ignore_eos=True)
    forks.join()
    s += " Number: " + rt.gen("number", regex=r"[0-9]{3}", temperature=0)


def test_dsl_programs_run_unchanged_over_http(runtime, http):
    over_zmq = program.run(question="Is 2+2 four?", backend=runtime)
    over_http = program.run(question="Is 2+2 four?", backend=http)
    for name in ("answer", "verdict", "idea", "number"):
        assert over_http[name] == over_zmq[name], name
    assert len(over_http["number"]) == 3 and over_http["number"].isdigit()
    assert over_http.get_meta_info("verdict")["normalized_logprobs"] == pytest.approx(
        over_zmq.get_meta_info("verdict")["normalized_logprobs"], abs=1e-5
    )
    assert over_http.text() == over_zmq.text()
    streamed = program.run(question="Is 2+2 four?", backend=http, stream=True)
    assert "".join(streamed.text_iter()) == over_zmq.text()


def test_prompt_logprobs_over_http_equal_zmq(runtime, http):
    """rt.RuntimeEndpoint over HTTP gives the ZeroMQ endpoint's shapes: pairs, and the first
    prompt token's logprob and top row null."""
    params = {**GREEDY, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    over_http = http.generate(PROMPT, params)["meta_info"]
    over_zmq = runtime.generate(PROMPT, params)["meta_info"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
        assert _close(over_http[key], over_zmq[key]), key
    assert over_http["input_top_logprobs"][0] is None


def _close(a, b) -> bool:
    """Equal, floats within 1e-5, inside lists and tuples alike."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-5
    return a == b


def test_stats_and_flush_cache_over_http(runtime, http):
    http.generate(PROMPT, GREEDY)
    stats = http.stats()
    assert stats["cached_tokens"] > 0 and "tenants" in stats
    assert http.flush_cache() is True
    stats = http.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
    tenant = rt.RuntimeEndpoint(runtime.http_url, api_key=ALICE, timeout=REPLY_TIMEOUT_S)
    with pytest.raises(PermissionError):
        tenant.flush_cache()


def test_http_endpoint_errors_carry_their_codes(runtime, http):
    with pytest.raises(ValueError) as bad:
        http.generate(PROMPT, {"max_new_token": 3})
    assert bad.value.code == "invalid_request" and "max_new_token" in bad.value.message
    with pytest.raises(PermissionError):
        rt.RuntimeEndpoint(runtime.http_url, api_key="wrong").generate(PROMPT, GREEDY)
    chunks = list(http.generate(PROMPT, GREEDY, stream=True))
    assert "".join(c["delta"] for c in chunks if not c["finished"]) == chunks[-1]["text"]
