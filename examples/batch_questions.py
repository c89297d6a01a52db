"""run_batch over 100 questions: the runtime batches them and shares the system prompt."""

from _common import run_example

import radixrt as rt


@rt.function
def answer(s, a, b):
    s += rt.system("You are a precise calculator. Reply with the number only.")
    s += rt.user(f"What is {a} + {b}?")
    s += rt.assistant(rt.gen("sum", max_tokens=8, stop="\n"))


def main(backend) -> None:
    states = answer.run_batch(
        [{"a": i, "b": 2 * i} for i in range(100)], backend=backend, temperature=0
    )
    right = sum(s["sum"].strip().startswith(str(3 * i)) for i, s in enumerate(states))
    print(f"{right}/100 sums right; first three: {[s['sum'].strip() for s in states[:3]]}")


if __name__ == "__main__":
    run_example(main)
