"""Tree of thought: fork 3 ideas, fork each into 2 critiques; every branch shares its parent's KV."""

from _common import run_example

import radixrt as rt


@rt.function
def tree(s, question):
    s += rt.user(question)
    s += rt.assistant_begin()
    ideas = s.fork(3)
    ideas += lambda i: f"Idea {i + 1}: " + rt.gen("idea", max_tokens=24, stop="\n", temperature=0.8)
    for idea in ideas:
        critiques = idea.fork(2)
        critiques += lambda j: (
            f"\nCritique {j + 1}: " + rt.gen("critique", max_tokens=20, stop="\n", temperature=0.8)
        )
        critiques.join()
    ideas.join()
    s += rt.assistant_end()


def main(backend) -> None:
    state = tree.run(question="How can a small town reduce traffic?", backend=backend)
    for i, idea in enumerate(state["idea"]):
        print(
            f"idea {i + 1}: {idea.strip()}  ({state.get_meta_info('idea')[i]['cached_tokens']} tokens cached)"
        )


if __name__ == "__main__":
    run_example(main)
