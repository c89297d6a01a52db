"""`make demo`: start a runtime process and run the example programs against it over ZeroMQ."""

import time

import agent_loop
import few_shot_qa
import multi_turn_chat
import parallel_decoding
import tree_of_thought

import radixrt as rt

SPEED_TOKENS = 64  # the one-stream decode shown before the programs


def one_stream_speed(runtime: rt.Runtime) -> None:
    """Print what the linears run as (`--quantization auto` serves the default GGUF as stored,
    and why) and one stream's decode speed: one greedy request of `SPEED_TOKENS` tokens."""
    info = runtime.model_info
    params = {"max_new_tokens": SPEED_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    out = runtime.generate("Once upon a time", params)
    tokens = out["meta_info"]["completion_tokens"]
    print(
        f"linears: {info['quantization']} ({info['quantization_reason']}); CPU path {info['cpu_isa']}"
    )
    print(f"one stream: {tokens / (time.monotonic() - start):.1f} tok/s over {tokens} tokens\n")


def main() -> None:
    with rt.Runtime(model="default", max_total_tokens=16384, log_level="warning") as runtime:
        print(f"runtime listening on {runtime.url}")
        one_stream_speed(runtime)
        for example in (
            multi_turn_chat,
            agent_loop,
            tree_of_thought,
            few_shot_qa,
            parallel_decoding,
        ):
            print(f"=== {example.__name__}: {example.__doc__.strip().splitlines()[0]}")
            example.main(runtime)
            print()
        stats = runtime.stats()
        print(
            f"cache hit rate: {stats['cache_hit_rate']:.0%} of prompt tokens came from the radix cache "
            f"({stats['cached_tokens']} tokens cached, {stats['num_preemptions']} preemptions)"
        )


if __name__ == "__main__":
    main()
