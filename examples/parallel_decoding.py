"""Skeleton-of-thought: write an outline, then expand every point in parallel forks."""

from _common import run_example

import radixrt as rt


@rt.function
def essay(s, topic, points=3):
    s += rt.user(f"Give {points} short headings, one per line, for an essay about {topic}.")
    s += rt.assistant(rt.gen("outline", max_tokens=48))
    s += rt.user("Now expand one heading in two sentences.")
    s += rt.assistant_begin()
    forks = s.fork(points)
    forks += lambda i: f"Heading {i + 1}: " + rt.gen("paragraph", max_tokens=48)
    forks.join()
    s += rt.assistant_end()


def main(backend) -> None:
    state = essay.run(topic="bicycles", backend=backend, temperature=0)
    print("outline:", state["outline"].strip())
    for i, paragraph in enumerate(state["paragraph"]):
        print(f"{i + 1}. {paragraph.strip()}")


if __name__ == "__main__":
    run_example(main)
