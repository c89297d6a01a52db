"""`make demo`: start a runtime process and run the example programs against it over ZeroMQ."""

import agent_loop
import few_shot_qa
import multi_turn_chat
import parallel_decoding
import tree_of_thought

import radixrt as rt


def main() -> None:
    with rt.Runtime(model="default", max_total_tokens=16384, log_level="warning") as runtime:
        print(f"runtime listening on {runtime.url}\n")
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
