"""The DSL against a real server process and the real default model."""

from __future__ import annotations

import asyncio
import itertools
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import radixrt as rt

from helpers import hf_greedy, launch_runtime

FEW_SHOT = (
    "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Spain?\nA: Madrid\n"
)


@pytest.fixture(scope="module")
def runtime(default_runtime):
    return default_runtime


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_choice_logprobs(model, tokenizer, prefix: str, choices: list[str]) -> list[list[float]]:
    """transformers' logprob of each token of each choice after `prefix`: the tokens of
    prefix + choice past their longest common token prefix with the prefix alone (the last token
    at least), each given all the tokens before it."""
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    scores = []
    for choice in choices:
        ids = tokenizer.encode(prefix + choice, add_special_tokens=False)
        common = next(
            (i for i, (a, b) in enumerate(zip(prefix_ids, ids, strict=False)) if a != b),
            min(len(prefix_ids), len(ids)),
        )
        common = min(common, len(ids) - 1)
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        scores.append([logprobs[p - 1, ids[p]].item() for p in range(common, len(ids))])
    return scores


def _close(got: list[float], expected: list[float], tol: float = 1e-3) -> bool:
    return len(got) == len(expected) and all(
        abs(a - b) < tol for a, b in zip(got, expected, strict=True)
    )


@rt.function
def few_shot(s, country):
    s += FEW_SHOT + f"Q: What is the capital of {country}?\nA:"
    s += rt.gen("answer", max_tokens=6, ignore_eos=True)


def test_few_shot_gen_equals_transformers(runtime, tokenizer, default_model_dir):
    state = few_shot.run(country="Italy", backend=runtime, temperature=0)
    prompt = FEW_SHOT + "Q: What is the capital of Italy?\nA:"
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = hf_greedy(default_model_dir, [prompt_ids], 6)[0]
    assert state["answer"] == tokenizer.decode(expected)
    assert state.text() == prompt + state["answer"]


def test_run_batch_equals_one_by_one(runtime):
    countries = ["Italy", "Germany", "Japan", "Peru", "Kenya"]
    batch = few_shot.run_batch(
        [{"country": c} for c in countries], backend=runtime, temperature=0, progress_bar=False
    )
    single = [few_shot.run(country=c, backend=runtime, temperature=0) for c in countries]
    assert [b["answer"] for b in batch] == [s["answer"] for s in single]


def test_roles_render_exactly_as_the_models_template(runtime, tokenizer):
    @rt.function
    def chat(s, with_system):
        if with_system:
            s += rt.system("Be brief.")
        s += rt.user("Hi there")
        with s.assistant():
            s += "Hello!"
        s += rt.user_begin() + "Bye" + rt.user_end()

    for with_system in (True, False):
        state = chat.run(with_system=with_system, backend=runtime)
        expected = tokenizer.apply_chat_template(state.messages(), tokenize=False)
        assert state.text() == expected
        assert ("You are a helpful AI assistant" in state.text()) is (not with_system)


def test_select_is_the_argmax_of_normalised_logprobs(runtime, tokenizer, hf_model):
    """The default method picks the choice with the best mean token logprob, as transformers
    computes it, and reports those means."""
    choices = ["Paris", "London", "a city in France", "Berlin"]

    @rt.function
    def pick(s):
        s += "The capital of France is "
        s += rt.select("city", choices=choices)

    state = pick.run(backend=runtime)
    logprobs = _hf_choice_logprobs(hf_model, tokenizer, "The capital of France is ", choices)
    scores = [sum(lps) / len(lps) for lps in logprobs]
    assert state["city"] == choices[max(range(len(choices)), key=scores.__getitem__)]
    assert _close(state.get_meta_info("city")["normalized_logprobs"], scores)


def test_streaming_deltas_join_to_the_value(runtime):
    @rt.function
    def story(s):
        s += rt.user("Tell me a one-line story about a cat.")
        s += rt.assistant(rt.gen("story", max_tokens=24))

    state = story.run(backend=runtime, stream=True, temperature=0)
    pieces = list(state.text_iter(var="story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]

    async def collect():
        state = story.run(backend=runtime, stream=True, temperature=0)
        return [p async for p in state.text_async_iter("story")], state

    pieces, state = asyncio.run(collect())
    assert "".join(pieces) == state["story"]


def test_fork_branches_find_the_pinned_prefix_under_cache_pressure(default_model_dir, tokenizer):
    prefix = "Here is a long shared context about the sea. " * 12
    with launch_runtime(
        default_model_dir,
        max_total_tokens=400,
    ) as r:

        @rt.function
        def branches(s):
            s += prefix
            forks = s.fork(3)
            for i in range(3):  # unrelated traffic that would evict an unpinned prefix
                r.generate(
                    f"Unrelated prompt {i}: " + "filler words here " * 40, {"max_new_tokens": 2}
                )
            assert r.stats()["protected_tokens"] >= len(tokenizer.encode(prefix)) - 1
            forks += lambda i: f" Point {i}:" + rt.gen("point", max_tokens=4, ignore_eos=True)
            forks.join()

        state = branches.run(backend=r, temperature=0)
        n_prefix = len(tokenizer.encode(prefix))
        assert all(m["cached_tokens"] >= n_prefix - 2 for m in state.get_meta_info("point"))
        assert len(state["point"]) == 3
        stats = r.stats()
        assert stats["pins"] == 0 and stats["protected_tokens"] == 0


def test_agent_loop_turns_hit_the_previous_turn(runtime):
    @rt.function
    def loop(s, turns):
        s += rt.system("You are a calculator. Reply with a number.")
        for k in range(turns):
            s += rt.user(f"Add {k} to the last number.")
            s += rt.assistant(rt.gen(f"turn{k}", max_tokens=6))

    runtime.flush_cache()
    state = loop.run(turns=4, backend=runtime, temperature=0)
    metas = [state.get_meta_info(f"turn{k}") for k in range(4)]
    for prev, cur in itertools.pairwise(metas):
        assert cur["cached_tokens"] >= prev["prompt_tokens"]


def test_errors_surface_as_exceptions(runtime):
    @rt.function
    def bad_param(s):
        s += "x" + rt.gen("y", max_tokens=4, temperature=-1)

    @rt.function
    def user_bug(s):
        s += "x"
        raise KeyError("boom")

    with pytest.raises(ValueError):
        bad_param.run(backend=runtime)
    with pytest.raises(KeyError):
        user_bug.run(backend=runtime)
    states = user_bug.run_batch([{}, {}], backend=runtime, progress_bar=False)
    with pytest.raises(RuntimeError, match="boom"):
        states[0].text()


def test_run_async_runs_200_programs(tiny_runtime):
    @rt.function
    def tiny(s, i):
        s += f"Program {i}:" + rt.gen("out", max_tokens=2, ignore_eos=True)

    async def main(r):
        return await asyncio.gather(
            *(tiny.run_async(i=i, backend=r, temperature=0) for i in range(200))
        )

    states = asyncio.run(main(tiny_runtime))
    assert len(states) == 200
    assert all(s.get_meta_info("out")["completion_tokens"] == 2 for s in states)


def test_gen_ebnf_and_lark_constrain_the_text(tiny_runtime):
    @rt.function
    def grammars(s):
        s += "Sum:" + rt.gen("sum", max_tokens=24, ebnf='root ::= [0-9]+ ("+" [0-9]+)*')
        s += "\nPair:" + rt.gen("pair", max_tokens=24, lark='start: "(" /[a-z]+/ ")"')

    state = grammars.run(backend=tiny_runtime, temperature=0)
    assert re.fullmatch(r"[0-9]+(\+[0-9]+)*\+?", state["sum"]), state["sum"]
    assert re.fullmatch(r"\([a-z]*\)?", state["pair"]), state["pair"]


@rt.function
def pick_with(s, prefix, choices, method):
    s += prefix
    s += rt.select("a", choices=choices, choices_method=method)


METHODS = ("token_length_normalized", "greedy", "unconditional")
EAT = "I like to eat"
# means: " apple pie" best (its second token is nearly certain); first tokens: " apples" best
FOODS = [" apple sauce", " apple pie", " apples", " bananas"]


def test_select_methods_disagree_and_each_follows_its_rule(runtime, tokenizer, hf_model):
    """On the same choices the default method picks the best mean token logprob (" apple pie") and
    greedy the best first token (" apples"); every method reports the same choices and the
    conditional token logprobs transformers computes, and appends its pick to the text."""
    expected = _hf_choice_logprobs(hf_model, tokenizer, EAT, FOODS)
    means = [sum(lps) / len(lps) for lps in expected]
    states = {
        m: pick_with.run(prefix=EAT, choices=FOODS, method=m, backend=runtime) for m in METHODS
    }
    assert states["token_length_normalized"]["a"] == FOODS[means.index(max(means))] == " apple pie"
    assert states["greedy"]["a"] == max(FOODS, key=lambda c: expected[FOODS.index(c)]) == " apples"
    for method, state in states.items():
        meta = state.get_meta_info("a")
        assert meta["method"] == method and meta["choices"] == FOODS
        assert all(
            _close(got, want) for got, want in zip(meta["token_logprobs"], expected, strict=True)
        )
        assert _close(meta["normalized_logprobs"], means)
        assert state.text() == EAT + state["a"]
    with pytest.raises(ValueError):
        rt.select("a", choices=["x"], choices_method="nope")


@pytest.mark.parametrize("choices", [FOODS[:2], FOODS[1::-1]])
def test_greedy_select_decides_a_shared_first_token_by_the_next(runtime, choices):
    """Two choices that start with the same token (" apple") get exactly the same first logprob,
    so greedy decides by the second token, whatever the order: " apple pie"."""
    state = pick_with.run(prefix=EAT, choices=choices, method="greedy", backend=runtime)
    sauce, pie = sorted(state.get_meta_info("a")["token_logprobs"], key=lambda lps: lps[1])
    assert sauce[0] == pie[0] and pie[1] > sauce[1]
    assert state["a"] == " apple pie"


def test_unconditional_select_keeps_the_obvious_answer(runtime):
    """Normalising by the choice's likelihood without the prefix must not make
    " Antidisestablishmentarianism" the capital of France."""
    choices = [" Paris", " Antidisestablishmentarianism"]
    state = pick_with.run(
        prefix="The capital of France is", choices=choices, method="unconditional", backend=runtime
    )
    assert state["a"] == " Paris"


def test_fork_of_an_empty_state(runtime):
    @rt.function
    def empty(s):
        forks = s.fork(2)
        forks += ["Hello", "Goodbye"]
        forks += rt.gen("rest", max_tokens=3, ignore_eos=True)
        forks.join()

    state = empty.run(backend=runtime, temperature=0)
    assert len(state["rest"]) == 2 and runtime.stats()["pins"] == 0
