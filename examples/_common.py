"""Shared by the examples: run one against a given backend, or start a runtime of its own."""

import sys

import radixrt as rt


def run_example(main) -> None:
    """`python examples/x.py [http://host:port | tcp://host:zmq_port]`: against a server (over
    HTTP or ZeroMQ), or a runtime started here."""
    if len(sys.argv) > 1:
        main(rt.RuntimeEndpoint(sys.argv[1]))
        return
    with rt.Runtime(model="default", max_total_tokens=16384, log_level="warning") as runtime:
        main(runtime)
        print(f"cache hit rate: {runtime.stats()['cache_hit_rate']:.0%}")
