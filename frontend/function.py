"""`@rt.function` programs and how they run: run, run_batch, run_async, streaming."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm

from radixrt.client.base import Endpoint

from .chat_template import ChatTemplate
from .state import Backend, ProgramState, run_program

_default_backend: Backend | None = None
_templates: dict[int, ChatTemplate] = {}
ASYNC_WORKERS = 64  # programs awaited on one event loop share these threads
_async_pool: ThreadPoolExecutor | None = None


def set_default_backend(backend: Backend) -> None:
    global _default_backend
    _default_backend = backend


def backend_or_default(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend= or call rt.set_default_backend(...)")
    return backend


def with_adapter(backend: Backend, lora_path: str) -> Endpoint:
    """`backend` (a runtime's endpoint) sending every request under the LoRA adapter
    `lora_path`: a shallow copy sharing its connection."""
    if not isinstance(backend, Endpoint):
        raise ValueError("lora_path needs a radixrt backend (RuntimeEndpoint, Runtime or Engine)")
    adapted = copy.copy(backend)
    adapted.options = dataclasses.replace(backend.options, lora_path=lora_path)
    return adapted


def _template(backend: Backend) -> ChatTemplate:
    if id(backend) not in _templates:
        _templates[id(backend)] = ChatTemplate.from_model_info(backend.model_info)
    return _templates[id(backend)]


class Function:
    def __init__(self, func: Callable[..., Any]):
        self.func = func
        functools.update_wrapper(self, func)

    def run(
        self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run once. Keyword arguments that the function does not take (temperature,
        max_new_tokens, top_p, ...) are defaults for every gen inside it; `lora_path` runs
        every gen (and fork) of the program under that LoRA adapter."""
        state = self._start(backend, kwargs, stream)
        if not stream and state._error is not None:
            raise state._error
        return state

    def _start(self, backend: Backend | None, kwargs: dict[str, Any], stream: bool) -> ProgramState:
        kwargs = dict(kwargs)
        lora_path = kwargs.pop("lora_path", None)
        args, defaults = self._split(kwargs)
        backend = backend_or_default(backend)
        template = _template(backend)
        if lora_path is not None:
            backend = with_adapter(backend, lora_path)
        return run_program(self.func, backend, template, defaults, args, stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
        **defaults: Any,
    ) -> list[ProgramState]:
        """Run many programs concurrently (so the runtime batches them); states in input order.
        A program that failed raises when its state is read."""
        workers = (
            min(len(batch_kwargs), 64, 4 * (os.cpu_count() or 1) + 16)
            if num_threads == "auto"
            else num_threads
        )
        with ThreadPoolExecutor(max(int(workers), 1)) as pool:
            futures = [
                pool.submit(self._start, backend, {**defaults, **kw}, False) for kw in batch_kwargs
            ]
            for _ in tqdm(
                as_completed(futures),
                total=len(futures),
                desc=self.func.__name__,
                disable=not progress_bar,
            ):
                pass
            return [f.result() for f in futures]

    async def run_async(self, *, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Await a program; thousands can be awaited at once on one event loop."""
        global _async_pool
        _async_pool = _async_pool or ThreadPoolExecutor(
            ASYNC_WORKERS, thread_name_prefix="radixrt-program"
        )
        return await asyncio.get_running_loop().run_in_executor(
            _async_pool, functools.partial(self.run, backend=backend, **kwargs)
        )

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import inspect

        params = inspect.signature(self.func).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        args = {k: v for k, v in kwargs.items() if takes_all or k in params}
        defaults = {
            ("max_new_tokens" if k == "max_tokens" else k): v
            for k, v in kwargs.items()
            if k not in args
        }
        return args, defaults

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def function(func: Callable[..., Any]) -> Function:
    """Decorator: `@rt.function def program(s, ...): s += ...`."""
    return Function(func)
