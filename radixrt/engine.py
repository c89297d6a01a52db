"""`rt.Engine`: the runtime in-process, its scheduler loop on a background thread."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Callable

from radixrt.config import ServerArgs
from radixrt.request import Req
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class Engine:
    """Offline engine: `generate`, `stats`, `flush_cache`, `shutdown`.

    Calls are thread-safe: requests from many threads are batched together by the loop.
    """

    def __init__(self, model: str = "default", **server_args: Any):
        self.args = ServerArgs.from_kwargs(model=model, **server_args)
        logging.basicConfig(level=self.args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
        self.scheduler = Scheduler(self.args)
        self.tokenizer = self.scheduler.tokenizer
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._waiters: dict[Req, Future] = {}
        self._closed = False
        self._loop_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="radixrt-scheduler", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 rid: str | list[str] | None = None) -> dict | list:
        """One prompt -> a result dict (a list of n dicts when n > 1); a list of prompts -> a list.

        `rid` names the request(s) for `abort`; by default each gets a fresh id.
        """
        prompts, single = self._normalize(prompt, input_ids)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        rids = [rid] if isinstance(rid, str) else rid or [uuid.uuid4().hex for _ in prompts]
        if len(params_list) != len(prompts) or len(rids) != len(prompts):
            raise ValueError("sampling_params and rid must be one value or one per prompt")
        groups = [self._make_requests(r, p, SamplingParams.from_dict(sp))
                  for r, p, sp in zip(rids, prompts, params_list)]
        futures = [[self._submit(r) for r in group] for group in groups]
        results = [[f.result() for f in group] for group in futures]
        results = [group[0] if len(group) == 1 else group for group in results]
        return results[0] if single else results

    def stats(self) -> dict[str, Any]:
        return self._call(self.scheduler.stats)

    def flush_cache(self) -> bool:
        return self._call(self.scheduler.flush_cache)

    def check_invariants(self) -> None:
        """Raise AssertionError if a KV slot, request row or lock count is out of place."""
        self._call(self.scheduler.check_invariants)

    def abort(self, rid: str) -> None:
        self._call(lambda: self._resolve(self.scheduler.abort(rid)))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(lambda: None)
            self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- plumbing ----------------------------------------------------------------------------
    def _normalize(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
            items = [prompt] if single else prompt
        else:
            single = not input_ids or not isinstance(input_ids[0], list)
            items = [input_ids] if single else input_ids
        if not isinstance(items, list) or not items:
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of them")
        return [self._encode(p) for p in items], single

    def _encode(self, item: Prompt) -> list[int]:
        if isinstance(item, str):
            return self.tokenizer.encode(item, add_special_tokens=False) or [self.tokenizer.bos_token_id or 0]
        if isinstance(item, list):
            return item
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(item).__name__}")

    def _make_requests(self, rid: str, ids: list[int], params: SamplingParams) -> list[Req]:
        if params.n == 1:
            return [self.scheduler.make_request(rid, ids, params)]
        return [self.scheduler.make_request(f"{rid}-{i}", ids, params, sample_index=i) for i in range(params.n)]

    def _submit(self, req: Req) -> Future:
        future: Future = Future()
        def add() -> None:
            self._waiters[req] = future
            self.scheduler.add_request(req)
        self._post(add)
        return future

    def _call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()
        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)
        self._post(run)
        return future.result()

    def _post(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._loop_error is not None:
            raise RuntimeError("the scheduler loop died") from self._loop_error
        self._inbox.put(fn)

    def _resolve(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.finished and req in self._waiters:
                self._waiters.pop(req).set_result(req.result())

    def _loop(self) -> None:
        try:
            while not self._closed:
                block = not self.scheduler.has_work()
                try:
                    while True:
                        self._inbox.get(block=block)()
                        block = False
                except queue.Empty:
                    pass
                if self.scheduler.has_work():
                    self._resolve(self.scheduler.step())
        except BaseException as e:
            logger.exception("scheduler loop failed")
            self._loop_error = e
            for future in self._waiters.values():
                future.set_exception(RuntimeError(f"scheduler loop failed: {e}"))
