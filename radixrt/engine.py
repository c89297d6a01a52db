"""`rt.Engine`: the runtime without a network server.

The scheduler runs in a child process (`radixrt serve` on a private ipc:// socket) on its own
main thread, reached with the same protocol as any client. A separate process keeps the forward loop off
this process's GIL and, on the CPU, gives it an OpenMP thread team of its own (parallel regions
started from a second thread of a process whose main thread already used OpenMP run several
times slower here).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from radixrt.client import RuntimeClient
from radixrt.config import ServerArgs

Prompt = str | list[int]
START_TIMEOUT_S = 600


class Engine:
    """`generate`, `stats`, `flush_cache`, `check_invariants`, `abort`, `shutdown`; thread-safe."""

    def __init__(self, model: str = "default", **server_args: Any):
        self.args = ServerArgs.from_kwargs(model=model, **server_args)
        self._tmp = Path(tempfile.mkdtemp(prefix="radixrt-"))
        self.args.host = f"ipc://{self._tmp / 'runtime.sock'}"
        self._proc = subprocess.Popen([sys.executable, "-m", "radixrt", "serve", *self.args.to_cli_args()])
        self.client = RuntimeClient(self.args.host)
        self._finalizer = weakref.finalize(self, _stop, self._proc, self.client, self._tmp)
        self._wait_ready()
        self.model_info = self.client.call("model_info")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_info["model_path"])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._finalizer()
                raise RuntimeError(f"the runtime exited with code {self._proc.returncode} while starting "
                                   "(its log is above)")
            try:
                self.client.call("health", timeout=0.5)
                return
            except TimeoutError:
                continue
        self._finalizer()
        raise RuntimeError(f"the runtime did not become healthy within {START_TIMEOUT_S}s")

    # ---- public API --------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 rid: str | list[str] | None = None) -> dict | list:
        """One prompt -> a result dict (a list of n dicts when n > 1); a list of prompts -> a list.

        `rid` names the request(s) for `abort`; by default each gets a fresh id.
        """
        items, single, key = _normalize(prompt, input_ids)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        rids = [rid] if isinstance(rid, str) else rid or [uuid.uuid4().hex for _ in items]
        if len(params_list) != len(items) or len(rids) != len(items):
            raise ValueError("sampling_params and rid must be one value or one per prompt")
        submissions = [self.client.submit(rid=r, sampling_params=sp or {}, **{key: item})
                       for r, item, sp in zip(rids, items, params_list)]
        outs = [_results(s.finals()) for s in submissions]
        return outs[0] if single else outs

    def stats(self) -> dict[str, Any]:
        return self.client.call("stats")

    def flush_cache(self) -> bool:
        return self.client.call("flush_cache")

    def check_invariants(self) -> None:
        """Raise if a KV slot, request row or lock count is out of place (see DESIGN.md)."""
        self.client.call("check_invariants")

    def abort(self, rid: str) -> None:
        self.client.abort(rid)

    def shutdown(self) -> None:
        if self._finalizer.alive:
            try:
                self.client.call("shutdown", timeout=30)
            except Exception:  # already gone: the finalizer kills it
                pass
            self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _normalize(prompt, input_ids) -> tuple[list, bool, str]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [prompt], True, "input_ids"
        items = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(items, list) or not items or not all(isinstance(p, str) for p in items):
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of strings")
        return items, isinstance(prompt, str), "text"
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return input_ids, False, "input_ids"
    return [input_ids], True, "input_ids"


def _results(finals: list[dict]) -> dict | list[dict]:
    outs = [{k: r[k] for k in ("text", "output_ids", "meta_info")} for r in finals]
    return outs[0] if len(outs) == 1 else outs


def _stop(proc: subprocess.Popen, client: RuntimeClient, tmp: Path) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    client.close()
    shutil.rmtree(tmp, ignore_errors=True)
