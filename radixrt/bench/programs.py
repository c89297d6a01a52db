"""Workloads that are LM programs written in the DSL, run over the socket with `run_batch`."""

from __future__ import annotations

import random
from typing import Any

from radixrt.bench.workloads import WORDS, words

PROGRAM_WORKLOADS = ("agent", "few-shot-select", "tree-of-thought")  # program_workloads' keys


def program_workloads(num_programs: int, seed: int = 0) -> dict[str, tuple[Any, list[dict]]]:
    """name -> (program, list of its keyword arguments): few-shot select, a ReAct-style agent, tree of thought."""
    import radixrt as rt

    rng = random.Random(seed)
    shots = "".join(
        f"Question: {words(rng, 12)}?\n(A) {rng.choice(WORDS)} (B) {rng.choice(WORDS)} "
        f"(C) {rng.choice(WORDS)} (D) {rng.choice(WORDS)}\nAnswer: {rng.choice('ABCD')}\n\n"
        for _ in range(5)
    )

    @rt.function
    def few_shot_select(s, question):
        s += shots + f"Question: {question}?\n(A) one (B) two (C) three (D) four\nAnswer: "
        s += rt.select("answer", choices=["A", "B", "C", "D"])

    tools = "You are an agent. Think, then act with one tool per turn.\n" + "".join(
        f"Tool {name}: {words(rng, 40)}. Input: {rng.choice(WORDS)}.\n"
        for name in ("search", "calculate", "lookup", "translate", "finish")
    )

    @rt.function
    def agent(s, task, observations):
        s += rt.system(tools)
        s += rt.user(task)
        for t, observation in enumerate(observations):
            s += rt.assistant("Thought: " + rt.gen(f"thought{t}", max_tokens=12, stop="\n"))
            s += rt.user(f"Observation {t}: the tool returned {observation}.")

    @rt.function
    def tree_of_thought(s, question):
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
        "few-shot-select": (few_shot_select, [{"question": q} for q in questions]),
        "agent": (
            agent,
            [
                {"task": f"Task {i}: {q}", "observations": [rng.randrange(100) for _ in range(4)]}
                for i, q in enumerate(questions[: max(num_programs // 4, 1)])
            ],
        ),
        "tree-of-thought": (
            tree_of_thought,
            [{"question": q} for q in questions[: max(num_programs // 10, 1)]],
        ),
    }
