"""What the router adds to time to first token on loopback: one worker, reached directly and
through `radixrt router`, in turns, with the same short prompts.

Each round sends one request directly and one through the router (the order alternates), one at
a time, so both paths see the same machine state; the report is each path's TTFT percentiles
and the median of the per-round differences.

    python scripts/router_overhead.py [--model default] [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import radixrt as rt
from radixrt.client.launcher import free_port


def ttft(endpoint: rt.RuntimeEndpoint, prompt: str) -> float:
    start = time.perf_counter()
    for _ in endpoint.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, stream=True):
        return time.perf_counter() - start
    raise AssertionError("no chunk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    with rt.Runtime(model=args.model, max_total_tokens=8192, log_level="warning") as worker:
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "radixrt", "router", "--port", str(port), "--worker", worker.url]
            + ["--log-level", "warning"]
        )
        routed = rt.RuntimeEndpoint(f"tcp://127.0.0.1:{port}", timeout=60)
        try:
            while True:
                try:
                    if routed.stats()["workers"][0]["alive"]:
                        break
                except TimeoutError:
                    pass
                time.sleep(0.1)
            for warm in range(3):
                ttft(worker, f"Warm-up {warm}.")
                ttft(routed, f"Warm-up {warm}.")
            direct, via, diffs = [], [], []
            for i in range(args.rounds):
                prompt = f"Question {i}: name a colour."  # fresh text: the same prefill either way
                paths = [(direct, worker), (via, routed)][:: 1 if i % 2 else -1]
                for times, endpoint in paths:
                    times.append(
                        ttft(
                            endpoint, prompt + (" (direct)" if endpoint is worker else " (routed)")
                        )
                    )
                diffs.append(via[-1] - direct[-1])
        finally:
            routed.close()
            router.terminate()
            router.wait(timeout=15)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(int(q * len(xs)), len(xs) - 1)] * 1000

    print(f"{args.rounds} rounds, model {args.model}")
    for name, xs in (("direct", direct), ("router", via)):
        print(f"  {name:7s} TTFT p50 {pct(xs, 0.5):7.2f} ms  p90 {pct(xs, 0.9):7.2f} ms")
    print(
        f"  added by the router: median of per-round differences {statistics.median(diffs) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
