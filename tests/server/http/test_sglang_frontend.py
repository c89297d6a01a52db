"""SGLang's own frontend (the `sglang` package's `lang`, installed without its GPU server) runs
SGLang programs unchanged against a real `radixrt serve` of the default model, and each gives
the same text at temperature 0 as the same program through radixrt's DSL (`rt.RuntimeEndpoint`).

The programs are written once over the DSL module (`sglang` or `radixrt`). SGLang's side runs in
a child process (this file as a script): `import sglang` patches transformers and sets cache
variables in its process, which must not leak into the rest of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
FEW_SHOT = (
    "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Germany?\nA: Berlin\n"
)
QUESTIONS = ["What is the capital of Italy?", "What is the capital of Spain?", "What is 2 + 2?"]
CHATML = "chatml"  # SGLang's template for the default model (SmolLM2 speaks ChatML)
# SGLang's frontend sends a `dtype` gen as these regexes and stops (sglang/lang/ir.py and its
# RuntimeEndpoint); radixrt's DSL sends `dtype` itself, a JSON value that cannot end in a space
SGLANG_DTYPES = {
    "int": (r"[-+]?[0-9]+[ \n]*", [" ", "\n"]),
    "float": (r"[-+]?[0-9]*\.?[0-9]+[ \n]*", [" ", "\n"]),
    "bool": (r"(True|False)", []),
    "str": (r"\"[\w\d\s]*\"", []),
}


def programs(lang) -> dict[str, Any]:
    """The programs, over `lang` (the `sglang` module or `radixrt`)."""

    @lang.function
    def few_shot(s, question):
        s += FEW_SHOT + "Q: " + question + "\nA:"
        s += lang.gen("answer", max_tokens=8, stop=["\n", "Q:"], temperature=0)

    @lang.function
    def choose(s):
        s += "Q: Is Paris in France? Answer yes or no.\nA:"
        s += lang.select("answer", choices=[" yes", " no", " maybe"])

    @lang.function
    def forked(s):
        s += "Two facts about the sea:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + lang.gen("fact", max_tokens=8, stop="\n", temperature=0)
        forks.join()
        s += "The end."

    def typed_gen(name, dtype):
        """SGLang's `dtype` gen; in radixrt's DSL, the request SGLang's frontend makes of it."""
        if lang.__name__ == "sglang":
            return lang.gen(name, dtype=dtype, max_tokens=6)
        regex, stop = SGLANG_DTYPES[name]
        return lang.gen(name, regex=regex, stop=stop or None, max_tokens=6)

    @lang.function
    def typed(s):
        s += "The year the Eiffel Tower was built: " + typed_gen("int", int)
        s += "\nPi to two places: " + typed_gen("float", float)
        s += "\nIs water wet (True or False)? " + typed_gen("bool", bool)
        s += "\nA colour, quoted: " + typed_gen("str", str)

    @lang.function
    def patterned(s):
        s += "An IP address: " + lang.gen("ip", regex=r"[0-9]{1,3}(\.[0-9]{1,3}){3}", max_tokens=16)

    @lang.function
    def json_person(s):
        s += "A person, as JSON: " + lang.gen(
            "person", json_schema=json.dumps(SCHEMA), max_tokens=32
        )

    @lang.function
    def chat(s):
        s += lang.system("You are a terse assistant.")
        s += lang.user("Name a colour.")
        s += lang.assistant(lang.gen("reply", max_tokens=8, temperature=0))

    @lang.function
    def at_least(s):
        s += "Count: one, two," + lang.gen("more", min_tokens=6, max_tokens=8)

    return {
        "few_shot": few_shot,
        "choose": choose,
        "forked": forked,
        "typed": typed,
        "patterned": patterned,
        "json_person": json_person,
        "chat": chat,
        "at_least": at_least,
    }


def run_all(lang, backend) -> dict[str, Any]:
    """Each program's final text and variables (or its error), as JSON-ready values."""
    progs = programs(lang)
    out: dict[str, Any] = {}

    def record(name, run):
        try:
            out[name] = run()
        except Exception as e:  # noqa: BLE001 (one program's failure is its own test's)
            out[name] = {"error": f"{type(e).__name__}: {e}"}

    def state(s, *names):
        return {"text": s.text(), **{n: s[n] for n in names}}

    greedy = {"backend": backend, "temperature": 0}
    record(
        "few_shot", lambda: state(progs["few_shot"].run(question=QUESTIONS[0], **greedy), "answer")
    )
    record("choose", lambda: state(progs["choose"].run(**greedy), "answer"))
    record("forked", lambda: state(progs["forked"].run(**greedy), "fact"))
    record("typed", lambda: state(progs["typed"].run(**greedy), "int", "float", "bool", "str"))
    record("patterned", lambda: state(progs["patterned"].run(**greedy), "ip"))
    record("json_person", lambda: state(progs["json_person"].run(**greedy), "person"))
    record("chat", lambda: state(progs["chat"].run(**greedy), "reply"))
    record("at_least", lambda: state(progs["at_least"].run(**greedy), "more"))
    record(
        "batch",
        lambda: [
            s["answer"]
            for s in progs["few_shot"].run_batch(
                [{"question": q} for q in QUESTIONS], backend=backend, temperature=0
            )
        ],
    )
    record("stream", lambda: _streamed(progs["few_shot"], backend))
    return out


def _streamed(prog, backend) -> dict[str, Any]:
    s = prog.run(question=QUESTIONS[1], backend=backend, temperature=0, stream=True)
    return {"pieces": "".join(s.text_iter()), "text": s.text()}


def _sglang_join_concatenates(sgl, backend) -> dict[str, Any]:
    """SGLang's `join("concate_and_append")`: the branches' text after the parent's, then on."""

    @sgl.function
    def joined(s):
        s += "Two colours:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" ({i + 1})" + sgl.gen("c", max_tokens=4, stop=[",", "\n", "("], temperature=0)
        forks.join("concate_and_append")
        s += " and more:" + sgl.gen("after", max_tokens=6, stop="\n", temperature=0)

    s = joined.run(backend=backend)
    return {"text": s.text(), "after": s["after"]}


def _sglang_main(url: str) -> None:
    """The child: SGLang's frontend over `url`, the results as JSON on stdout's last line."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(url, chat_template_name=CHATML)
    out = run_all(sgl, backend)
    try:
        out["concate_and_append"] = _sglang_join_concatenates(sgl, backend)
    except Exception as e:  # noqa: BLE001
        out["concate_and_append"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


if __name__ == "__main__":
    _sglang_main(sys.argv[1])
else:
    # the default model, SGLang's import and each program twice: minutes on a loaded 2-core CPU
    pytestmark = [pytest.mark.model, pytest.mark.timeout(1800)]

    import radixrt as rt

    from timeouts import REPLY_TIMEOUT_S

    @pytest.fixture(scope="module")
    def sglang_results(default_runtime) -> dict[str, Any]:
        """Every program through SGLang's frontend, in a child process."""
        pytest.importorskip("sglang", reason="`make test` installs sglang's frontend (--no-deps)")
        tests = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
        child = subprocess.run(
            [sys.executable, __file__, default_runtime.http_url],
            capture_output=True,
            text=True,
            env=env,
            timeout=30 * REPLY_TIMEOUT_S,
        )
        assert child.returncode == 0, child.stderr[-4000:]
        return json.loads(child.stdout.strip().splitlines()[-1])

    @pytest.fixture(scope="module")
    def radixrt_results(default_runtime) -> dict[str, Any]:
        """Every program through radixrt's DSL over the same HTTP API."""
        backend = rt.RuntimeEndpoint(default_runtime.http_url, timeout=REPLY_TIMEOUT_S)
        return json.loads(json.dumps(run_all(rt, backend)))

    def _both(sglang_results, radixrt_results, name: str) -> tuple[Any, Any]:
        theirs, ours = sglang_results[name], radixrt_results[name]
        assert "error" not in theirs, theirs
        assert "error" not in ours, ours
        return theirs, ours

    @pytest.mark.parametrize(
        "name",
        ["few_shot", "forked", "typed", "patterned", "json_person", "chat", "at_least", "batch"],
    )
    def test_same_text_as_radixrts_dsl(sglang_results, radixrt_results, name):
        theirs, ours = _both(sglang_results, radixrt_results, name)
        assert theirs == ours

    def test_few_shot_stops_at_the_newline(sglang_results):
        answer = sglang_results["few_shot"]["answer"]
        assert answer.strip() and "\n" not in answer and "Q:" not in answer

    def test_select_with_token_healing(sglang_results, radixrt_results):
        """SGLang's select scores each choice from two tokens before its prompt's end (reading
        the first `input_token_logprobs` entry's text); it picks what radixrt's select picks."""
        theirs, ours = _both(sglang_results, radixrt_results, "choose")
        assert theirs["answer"] in (" yes", " no", " maybe")
        assert theirs == ours

    def test_fork_gathers_each_branch(sglang_results):
        facts = sglang_results["forked"]["fact"]
        assert len(facts) == 2 and all(isinstance(f, str) for f in facts)

    def test_dtype_gens(sglang_results):
        """SGLang's dtype gens hold to their types (the text compared above)."""
        typed = sglang_results["typed"]
        assert "error" not in typed, typed
        int(typed["int"]), float(typed["float"])
        assert typed["bool"] in ("True", "False") and typed["str"].startswith('"')

    def test_regex_and_json_schema_hold(sglang_results):
        import re

        assert re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,3}){3}", sglang_results["patterned"]["ip"])
        person = json.loads(sglang_results["json_person"]["person"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)

    def test_chat_renders_the_models_template(sglang_results):
        text = sglang_results["chat"]["text"]
        assert text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
        assert "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n" in text

    def test_streamed_text_is_the_whole_text(sglang_results, radixrt_results):
        theirs, ours = _both(sglang_results, radixrt_results, "stream")
        assert theirs["text"] == ours["text"]
        assert theirs["text"].endswith(theirs["pieces"]) and theirs["pieces"]

    def test_join_concate_and_append(sglang_results):
        joined = sglang_results["concate_and_append"]
        assert "error" not in joined, joined
        assert joined["text"].startswith("Two colours: (1)") and " (2)" in joined["text"]
        assert joined["text"].endswith(" and more:" + joined["after"])
