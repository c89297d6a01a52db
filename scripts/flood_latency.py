"""A real request's latency with and without a keyless flood of one-byte frames (issue 39).

`python scripts/flood_latency.py [--model default] [--dp-size 2] [--rounds 5]`: a runtime (or a
`--dp-size` fleet) on loopback; each round times one 8-token greedy request alone,
then one sent while another thread floods the socket, and prints the medians, the ratio, how
many flood frames were sent and how many refusals came back (the per-peer budget drops the rest).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import zmq

import radixrt as rt

KEY = "flood-key"
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def flood(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    while not stop.is_set():
        try:
            sock.send(b"\x01", zmq.NOBLOCK)
            counts["sent"] += 1
        except zmq.Again:
            time.sleep(0.0005)
        while sock.poll(0):
            sock.recv()
            counts["answered"] += 1
    ctx.destroy(linger=0)


def timed(endpoint) -> float:
    start = time.perf_counter()
    endpoint.generate(input_ids=[5, 6, 7, 8], sampling_params=PARAMS)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with rt.Runtime(
        args.model,
        api_key=KEY,
        dp_size=args.dp_size,
        disable_http=True,
        max_total_tokens=2048,
        log_level="warning",
    ) as runtime:
        client = rt.RuntimeEndpoint(runtime.url, api_key=KEY, timeout=60)
        timed(client)  # warm
        alone, flooded, counts = [], [], {"sent": 0, "answered": 0}
        for _ in range(args.rounds):
            alone.append(timed(client))
            stop = threading.Event()
            thread = threading.Thread(target=flood, args=(runtime.url, stop, counts))
            thread.start()
            time.sleep(1.0)
            flooded.append(timed(client))
            stop.set()
            thread.join()
        client.close()
    a, f = statistics.median(alone), statistics.median(flooded)
    print(f"dp_size={args.dp_size} rounds={args.rounds}")
    print(
        f"request alone: median {a * 1000:.0f} ms; during the flood: median {f * 1000:.0f} ms"
        f" ({f / a:.2f}x)"
    )
    print(f"flood frames sent: {counts['sent']}, refusals answered: {counts['answered']}")


if __name__ == "__main__":
    main()
