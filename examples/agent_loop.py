"""A ReAct-style agent: `select` the action, Python runs the tool, the result goes back in."""

from _common import run_example

import radixrt as rt

TOOLS = {
    "calculator": lambda arg: str(
        eval(arg, {"__builtins__": {}})
    ),  # demo only: arithmetic on our own strings
    "clock": lambda arg: "It is 10:42.",
}


@rt.function
def agent(s, task, steps=3):
    s += rt.system(
        "You solve tasks with tools: calculator (arithmetic), clock (the time). "
        "Answer 'finish' when done."
    )
    s += rt.user(task)
    for step in range(steps):
        s += rt.assistant_begin() + "Action: "
        s += rt.select(f"action{step}", choices=["calculator", "clock", "finish"])
        if s[f"action{step}"] == "finish":
            s += rt.assistant_end()
            break
        s += "\nInput: " + rt.gen(f"input{step}", max_tokens=16, stop="\n")
        s += rt.assistant_end()
        observation = TOOLS[s[f"action{step}"]](s[f"input{step}"].strip() or "0")
        s += rt.user(f"Observation: {observation}")
    s += rt.assistant("Final answer: " + rt.gen("answer", max_tokens=24, stop="\n"))


def main(backend) -> None:
    state = agent.run(task="What is 12 * 7?", backend=backend, temperature=0)
    print(state.text())


if __name__ == "__main__":
    run_example(main)
