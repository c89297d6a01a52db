"""Multi-turn chat: each turn resends the history, which the radix cache already holds."""

from _common import run_example

import radixrt as rt


@rt.function
def chat(s, turns):
    s += rt.system("You are a friendly assistant. Keep answers to one sentence.")
    for i, message in enumerate(turns):
        s += rt.user(message)
        s += rt.assistant(rt.gen(f"reply{i}", max_tokens=40))


def main(backend) -> None:
    turns = [
        "Hi! I'm planning a trip to Rome.",
        "What should I see first?",
        "And where should I eat?",
    ]
    state = chat.run(turns=turns, backend=backend, temperature=0)
    for i, message in enumerate(turns):
        meta = state.get_meta_info(f"reply{i}")
        print(
            f"user: {message}\nassistant: {state[f'reply{i}'].strip()}\n"
            f"   ({meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens cached)"
        )


if __name__ == "__main__":
    run_example(main)
