"""Workloads that are LM programs written in the DSL, run over the socket with `run_batch`."""

from __future__ import annotations

import random
from typing import Any

from radixrt.bench.workloads import WORDS, words

PROGRAM_WORKLOADS = ("agent", "few-shot-select", "tree-of-thought")  # program_workloads' keys


def program_workloads(
    num_programs: int, seed: int = 0
) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    """name -> (program, list of its keyword arguments): few-shot select, a ReAct-style agent,
    tree of thought. A program's state `s` is the DSL's ProgramState; mypy sees the DSL only as
    `radixrt.frontend`, which the editable install maps onto frontend/ where mypy does not look,
    so the programs' arguments are typed Any and `rt.function` is applied by call (an untyped
    decorator would untype them)."""
    import radixrt.frontend as rt

    rng = random.Random(seed)
    shots = "".join(
        f"Question: {words(rng, 12)}?\n(A) {rng.choice(WORDS)} (B) {rng.choice(WORDS)} "
        f"(C) {rng.choice(WORDS)} (D) {rng.choice(WORDS)}\nAnswer: {rng.choice('ABCD')}\n\n"
        for _ in range(5)
    )

    def few_shot_select(s: Any, question: str) -> None:
        s += shots + f"Question: {question}?\n(A) one (B) two (C) three (D) four\nAnswer: "
        s += rt.select("answer", choices=["A", "B", "C", "D"])

    tools = "You are an agent. Think, then act with one tool per turn.\n" + "".join(
        f"Tool {name}: {words(rng, 40)}. Input: {rng.choice(WORDS)}.\n"
        for name in ("search", "calculate", "lookup", "translate", "finish")
    )

    def agent(s: Any, task: str, observations: list[int]) -> None:
        s += rt.system(tools)
        s += rt.user(task)
        for t, observation in enumerate(observations):
            s += rt.assistant("Thought: " + rt.gen(f"thought{t}", max_tokens=12, stop="\n"))
            s += rt.user(f"Observation {t}: the tool returned {observation}.")

    def tree_of_thought(s: Any, question: str) -> None:
        s += rt.user(question)
        s += rt.assistant_begin()
        ideas = s.fork(3)
        ideas += lambda i: f"Idea {i}: " + rt.gen("idea", max_tokens=8)
        for idea in ideas:
            branches = idea.fork(3)
            branches += lambda j: f" Step {j}: " + rt.gen("step", max_tokens=8)
            branches.join()
        ideas.join()

    questions = [words(rng, 10) for _ in range(num_programs)]
    return {
        "few-shot-select": (rt.function(few_shot_select), [{"question": q} for q in questions]),
        "agent": (
            rt.function(agent),
            [
                {"task": f"Task {i}: {q}", "observations": [rng.randrange(100) for _ in range(4)]}
                for i, q in enumerate(questions[: max(num_programs // 4, 1)])
            ],
        ),
        "tree-of-thought": (
            rt.function(tree_of_thought),
            [{"question": q} for q in questions[: max(num_programs // 10, 1)]],
        ),
    }
