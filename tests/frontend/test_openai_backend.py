"""`rt.OpenAI`: DSL programs against an OpenAI-compatible server (radixrt's own gateway, the tiny
model with the default model's chat template), compared with the same programs on the runtime."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import radixrt as rt

from timeouts import REPLY_TIMEOUT_S

GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def runtime(tiny_runtime):
    return tiny_runtime


@pytest.fixture(scope="module")
def chat_backend(runtime):
    with rt.OpenAI(
        "default", base_url=f"{runtime.http_url}/v1", max_retries=0, timeout=REPLY_TIMEOUT_S
    ) as backend:
        yield backend


@pytest.fixture(scope="module")
def text_backend(runtime):
    """A completion model whose roles render with the runtime's own chat template."""
    info = runtime.model_info
    with rt.OpenAI(
        "default",
        base_url=f"{runtime.http_url}/v1",
        is_chat_model=False,
        chat_template=info["chat_template"],
        special_tokens=info["special_tokens"],
        max_retries=0,
        timeout=REPLY_TIMEOUT_S,
    ) as backend:
        yield backend


@rt.function
def qa(s, question):
    s += rt.system("You are a helpful assistant.")
    s += rt.user(question)
    s += rt.assistant(rt.gen("answer", **GREEDY))


def test_chat_program_equals_the_runtime(runtime, chat_backend):
    """The chat server renders the roles as messages with the same template the runtime's
    program text uses, so greedy answers agree; usage comes back as meta info."""
    on_openai = qa.run(question="What is 2+2?", backend=chat_backend)
    on_runtime = qa.run(question="What is 2+2?", backend=runtime)
    assert on_openai["answer"] == on_runtime["answer"]
    assert on_openai.messages() == on_runtime.messages()
    meta = on_openai.get_meta_info("answer")
    assert meta["completion_tokens"] == on_runtime.get_meta_info("answer")["completion_tokens"]
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] > 0


def test_streamed_chat_program_joins_to_the_whole_answer(chat_backend):
    whole = qa.run(question="Name a colour.", backend=chat_backend)
    streamed = qa.run(question="Name a colour.", backend=chat_backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == whole["answer"]
    streamed_meta, whole_meta = streamed.get_meta_info("answer"), whole.get_meta_info("answer")
    assert streamed_meta["completion_tokens"] == whole_meta["completion_tokens"]
    assert streamed_meta["finish_reason"] == whole_meta["finish_reason"]


def test_completion_program_equals_the_runtime(runtime, text_backend):
    """A completion model gets the program's text, roles rendered by `chat_template`."""
    on_openai = qa.run(question="What is 2+2?", backend=text_backend)
    on_runtime = qa.run(question="What is 2+2?", backend=runtime)
    assert on_openai.text() == on_runtime.text()


def test_json_schema_gen_and_logprobs_on_a_chat_model(chat_backend):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    @rt.function
    def structured(s):
        s += rt.user("Give a number as JSON.")
        s += rt.assistant(
            rt.gen("out", max_tokens=16, temperature=0, json_schema=schema, return_logprob=True)
        )

    state = structured.run(backend=chat_backend)
    assert set(json.loads(state["out"])) == {"n"}
    tokens = state.get_meta_info("out")["output_token_logprobs"]
    assert "".join(text for _, text in tokens) == state["out"]
    assert all(lp <= 0 for lp, _ in tokens)


def test_chat_select_is_a_constrained_pick(chat_backend):
    @rt.function
    def verdict(s):
        s += rt.user("Is the sky blue? Answer yes or no.")
        s += rt.assistant(rt.select("verdict", choices=["yes", "no", "maybe not"]))

    state = verdict.run(backend=chat_backend)
    assert state["verdict"] in ("yes", "no", "maybe not")
    assert state.get_meta_info("verdict")["method"] == "constrained"
    assert state.messages()[-1] == {"role": "assistant", "content": state["verdict"]}


def _gateway_echoes(runtime) -> bool:
    """Whether /v1/completions echoes prompt logprobs (issue 29 item 5 adds `echo`)."""
    body = {"model": "default", "prompt": "a b", "max_tokens": 0, "echo": True, "logprobs": 0}
    request = urllib.request.Request(
        f"{runtime.http_url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
            logprobs = json.load(reply)["choices"][0].get("logprobs") or {}
    except urllib.error.HTTPError:
        return False
    return bool(logprobs.get("text_offset")) and logprobs["text_offset"][0] == 0


def test_completion_select_scores_like_the_runtime(runtime, text_backend):
    """With echo, the choices' mean token logprobs equal the runtime's select scores; a server
    without echo gets a SelectUnsupported that says so (never a silent guess)."""

    @rt.function
    def pick(s):
        s += "The capital of France is"
        s += rt.select("city", choices=[" Paris", " London", " a city"])

    if not _gateway_echoes(runtime):
        with pytest.raises(rt.SelectUnsupported, match="echo"):
            pick.run(backend=text_backend)
        return
    on_openai, on_runtime = pick.run(backend=text_backend), pick.run(backend=runtime)
    assert on_openai["city"] == on_runtime["city"]
    assert on_openai.get_meta_info("city")["normalized_logprobs"] == pytest.approx(
        on_runtime.get_meta_info("city")["normalized_logprobs"], abs=1e-4
    )


def test_fork_and_run_batch(chat_backend):
    @rt.function
    def two_turns(s, topic):
        s += rt.user(f"Say something about {topic}.")
        forks = s.fork(2)
        forks += rt.assistant(rt.gen("idea", **GREEDY))
        forks.join()

    states = two_turns.run_batch(
        [{"topic": "cats"}, {"topic": "dogs"}], backend=chat_backend, progress_bar=False
    )
    for state, topic in zip(states, ("cats", "dogs")):
        first, second = state["idea"]
        assert first == second == qa_answer(chat_backend, f"Say something about {topic}.")


def qa_answer(backend, question: str) -> str:
    @rt.function
    def ask(s):
        s += rt.user(question)
        s += rt.assistant(rt.gen("a", **GREEDY))

    return ask.run(backend=backend)["a"]


def test_chat_model_refuses_what_it_cannot_send(chat_backend):
    @rt.function
    def continued(s):
        s += rt.user("Hi")
        s += rt.assistant("Sure: " + rt.gen("rest", max_tokens=2))

    with pytest.raises(ValueError, match="first thing in an assistant role"):
        continued.run(backend=chat_backend)

    @rt.function
    def unconditional(s):
        s += rt.user("Hi")
        s += rt.assistant(rt.select("x", ["a", "b"], choices_method="unconditional"))

    with pytest.raises(rt.SelectUnsupported, match="start-of-text"):
        unconditional.run(backend=chat_backend)
    with pytest.raises(ValueError, match="radixrt backend"):
        rt.chat([{"role": "user", "content": "Hi"}], backend=chat_backend)
