"""Quick start: the offline engine on the default model, with a shared system prompt.

Run with `make demo` (or `.venv/bin/python examples/quickstart.py`).
"""

import radixrt as rt

SYSTEM = "You are a concise assistant. Answer in one sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Name a mammal that can fly.",
]


def main() -> None:
    with rt.Engine(model="default", max_total_tokens=8192, log_level="warning") as engine:
        prompts = [
            engine.tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for q in QUESTIONS
        ]
        for round_ in ("cold cache", "warm cache"):
            outputs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 48})
            print(f"--- {round_}")
            for question, out in zip(QUESTIONS, outputs):
                meta = out["meta_info"]
                print(
                    f"Q: {question}\nA: {out['text'].strip()}\n   "
                    f"({meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} from cache, "
                    f"{meta['completion_tokens']} generated)"
                )
        stats = engine.stats()
        print(
            f"cache hit rate: {stats['cache_hit_rate']:.0%}; KV pool: {stats['total_tokens']} tokens, "
            f"{stats['cached_tokens']} held by the radix tree"
        )


if __name__ == "__main__":
    main()
