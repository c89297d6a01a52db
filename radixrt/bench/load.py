"""Load generators: a closed loop (N clients, each starting its next session when one ends) and an
open loop (sessions arriving as a Poisson process at a request rate), both bounded in count and time."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from radixrt.bench.metrics import RequestTrace
from radixrt.bench.workloads import Session

# The longest wait for one reply: minutes on a loaded 2-core CPU, never half an hour; a stuck
# runtime fails the run instead of hanging it.
REPLY_TIMEOUT_S = 1800.0


@dataclass
class Load:
    # open loop: sessions per second (None: every session at once)
    request_rate: float | None = None
    concurrency: int | None = None  # closed loop: this many clients (overrides request_rate)
    max_duration_s: float | None = None  # start no session after this
    seed: int = 0
    # at most this many sessions in flight; the others wait for a place, and their requests'
    # times count from when they are sent (vLLM's --max-concurrency)
    max_concurrency: int | None = None

    def describe(self) -> str:
        if self.concurrency:
            return f"closed loop, {self.concurrency} clients"
        arrivals = (
            f"open loop, Poisson at {self.request_rate:g} req/s"
            if self.request_rate
            else "all at once"
        )
        return (
            f"{arrivals}, at most {self.max_concurrency} in flight"
            if self.max_concurrency
            else arrivals
        )


Render = Callable[[list[dict[str, str]]], str]


def run_session(
    target: Any, session: Session, render: Render, sent: float | None = None
) -> list[RequestTrace]:
    """Run one session's turns in order over `target.generate(..., stream=True)`; a chat session
    resends its history, answers included, every turn."""
    traces = []
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for i, turn in enumerate(session.turns):
        if session.chat:
            messages.append({"role": "user", "content": turn.text})
            prompt = render(messages)
        else:
            prompt = turn.text
        trace = RequestTrace(
            sent=sent if i == 0 and sent is not None else time.monotonic(),
            tag=session.tag if len(session.turns) == 1 else f"turn-{i + 1}",
        )
        text = stream_into(trace, target.generate(prompt, turn.params, stream=True))
        traces.append(trace)
        if trace.error:
            break
        messages.append({"role": "assistant", "content": text})
    return traces


def stream_into(trace: RequestTrace, chunks: Iterable[dict[str, Any]]) -> str:
    """Fill `trace` from a stream of generate chunks; returns the final text."""
    try:
        for chunk in chunks:
            now = time.monotonic()
            if not chunk["finished"]:
                if chunk["token_ids"]:
                    trace.chunk_times.append(now)
                    trace.chunk_tokens.append(len(chunk["token_ids"]))
                continue
            meta = chunk["meta_info"]
            # tokens only the final map carried
            held = len(chunk["output_ids"]) - trace.output_tokens
            if held > 0:
                trace.chunk_times.append(now)
                trace.chunk_tokens.append(held)
            trace.done = now
            trace.prompt_tokens = meta["prompt_tokens"]
            trace.cached_tokens = meta["cached_tokens"]
            trace.forward_passes = meta.get("forward_passes", 0)
            if meta["finish_reason"]["type"] == "abort":
                trace.error = meta["finish_reason"].get("message", "aborted")
            text: str = chunk["text"]
            return text
    except Exception as e:  # noqa: BLE001 - a failed request is a result of the benchmark
        trace.error = f"{type(e).__name__}: {e}"
    return ""


def run_load(
    target: Any, sessions: list[Session], load: Load, render: Render, desc: str = "requests"
) -> tuple[list[RequestTrace], float]:
    """Drive `sessions` against `target` under `load`; returns every request's trace and the wall time."""
    traces: list[RequestTrace] = []
    lock = threading.Lock()
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=desc, leave=False)
    start = time.monotonic()
    deadline = start + load.max_duration_s if load.max_duration_s else float("inf")

    places = threading.Semaphore(load.max_concurrency or len(sessions) or 1)

    def run(session: Session, sent: float | None = None) -> None:
        with places:
            result = run_session(target, session, render, None if load.max_concurrency else sent)
        with lock:
            traces.extend(result)
            bar.update(len(result))

    if load.concurrency:
        todo: queue.Queue[Session] = queue.Queue()
        for s in sessions:
            todo.put(s)

        def client() -> None:
            while time.monotonic() < deadline:
                try:
                    run(todo.get_nowait())
                except queue.Empty:
                    return

        threads = [threading.Thread(target=client, daemon=True) for _ in range(load.concurrency)]
        for t in threads:
            t.start()
    else:
        rng = random.Random(load.seed)
        threads, arrival = [], start
        for session in sessions:
            if arrival > deadline:
                break
            time.sleep(max(0.0, arrival - time.monotonic()))
            threads.append(threading.Thread(target=run, args=(session, arrival), daemon=True))
            threads[-1].start()
            if load.request_rate:
                arrival += rng.expovariate(load.request_rate)
    for t in threads:
        t.join()
    bar.close()
    return traces, time.monotonic() - start
