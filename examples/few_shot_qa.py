"""Few-shot QA: every question reuses the cached examples."""

from _common import run_example

import radixrt as rt

EXAMPLES = "".join(
    f"Q: {q}\nA: {a}\n"
    for q, a in [
        ("What is the capital of France?", "Paris"),
        ("What is 3 + 4?", "7"),
        ("What color is the sky on a clear day?", "Blue"),
    ]
)


@rt.function
def qa(s, question):
    s += EXAMPLES + f"Q: {question}\nA:"
    s += rt.gen("answer", max_tokens=16, stop="\n")


def main(backend) -> None:
    for question in ["What is the capital of Japan?", "What is 10 - 3?"]:
        state = qa.run(question=question, backend=backend, temperature=0)
        print(
            f"Q: {question}\nA:{state['answer']}  ({state.get_meta_info('answer')['cached_tokens']} tokens cached)"
        )


if __name__ == "__main__":
    run_example(main)
