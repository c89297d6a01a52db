"""Program state: the text so far, variables, meta info, roles, forks and streaming.

Expressions run as they are appended (`s += gen(...)` sends the request and waits), so a program
is plain Python; concurrency comes from running many programs at once (`run_batch`) and from
forks, whose branches run in parallel. The runtime batches all of them together.
"""

from __future__ import annotations

import enum
import json
import queue
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple, TypeAlias

from radixrt.client.base import Chunk, Endpoint, Result
from radixrt.client.transport import InvalidRequestError

from .chat_template import ChatTemplate
from .openai_backend import OpenAI, ProgramPrompt
from .primitives import Gen, Role, Select
from .tools import ToolRequest, parsed_calls


class _End(enum.Enum):
    """The end of a streamed run's pieces."""

    END = enum.auto()


Backend: TypeAlias = Endpoint | OpenAI  # a Runtime, an Engine or connect(url), or rt.OpenAI


class ProgramState:
    def __init__(
        self,
        backend: Backend,
        template: ChatTemplate,
        defaults: dict[str, Any],
        stream: bool = False,
    ):
        self.backend = backend
        self.template = template
        self.defaults = defaults
        self._text = ""
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._role: tuple[str, int] | None = None  # open role and where its content starts
        # (the variable it is in, a piece of text) as it is appended, then the end
        self._stream: queue.Queue[tuple[str | None, str] | _End] | None = (
            queue.Queue() if stream else None
        )
        self._done = threading.Event()
        self._runner: int | None = None  # the thread running the program
        self._error: BaseException | None = None
        self.ret_value: Any = None

    # ---- appending ---------------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self._run(expr)
        return self

    def _run(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Role):
            self._role_expr(expr)
        elif isinstance(expr, (list, tuple)):
            for item in expr:
                self._run(item)
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _append(self, text: str, var: str | None = None) -> None:
        self._text += text
        if self._stream is not None and text:
            self._stream.put((var, text))

    def _gen(self, g: Gen) -> None:
        params = g.sampling_params(self.defaults)
        tools = None
        if g.tools:
            if isinstance(self.backend, OpenAI):
                raise ValueError("gen(tools=...) needs a radixrt backend, not rt.OpenAI")
            tools = ToolRequest.of(self.backend, g.tools, g.tool_choice, g.parallel_tool_calls)
            if tools.constraint is not None:
                params.update(tools.constraint.params())
        if self._role and self._role[0] == "assistant" and not isinstance(self.backend, OpenAI):
            params.setdefault("stop_token_ids", self._end_of_turn_ids(self.backend))
        if self._stream is None:
            out = self._generate(params)
            self._append(out["text"], g.name)
        else:
            pieces = []
            for chunk in self._generate_stream(params):
                if chunk["finished"]:
                    out = chunk
                else:
                    pieces.append(chunk["delta"])
                    self._append(chunk["delta"], g.name)
        if tools is None:
            self._set(g.name, _typed(out["text"], g.dtype), out["meta_info"])
        else:
            content, calls = tools.read(out["text"])
            self._set(g.name, parsed_calls(calls), {**out["meta_info"], "content": content})

    def _generate(self, params: dict[str, Any]) -> Result:
        """One gen's result (`{"text", "meta_info", ...}`) for the text so far."""
        if isinstance(self.backend, OpenAI):
            return self.backend.generate(self._prompt(), params)
        out = self.backend.generate(self._text, params)
        assert isinstance(out, dict), "one prompt, one sample"
        return out

    def _generate_stream(self, params: dict[str, Any]) -> Iterator[Chunk]:
        """One gen's chunks (`{"delta", "finished"}`, the last with the result)."""
        if isinstance(self.backend, OpenAI):
            return self.backend.generate(self._prompt(), params, stream=True)
        return self.backend.generate(self._text, params, stream=True)

    def _select(self, sel: Select) -> None:
        if isinstance(self.backend, OpenAI):
            best, meta = self.backend.select(self._prompt(), sel)
        else:
            endpoint = self.backend
            prompts = self._choice_prompts(endpoint, self._text, sel.choices)
            unconditional = None
            if sel.method == "unconditional":
                unconditional = self._logprobs(endpoint, self._unconditional(endpoint, prompts))
            best, meta = sel.pick(self._logprobs(endpoint, prompts), unconditional)
        self._append(sel.choices[best], sel.name)
        self._set(sel.name, sel.choices[best], meta)

    def _prompt(self) -> ProgramPrompt:
        """What a gen sends `rt.OpenAI`: the text with the messages and the open role."""
        role, start = self._role or (None, len(self._text))
        return ProgramPrompt(self._text, list(self._messages), role, self._text[start:])

    @staticmethod
    def _choice_prompts(
        endpoint: Endpoint, prefix_text: str, choices: list[str]
    ) -> list[ChoicePrompt]:
        """Each choice after `prefix_text` as token ids, with the position its own tokens start at
        (after the longest common token prefix with the prefix alone)."""
        prefix = endpoint.tokenize(prefix_text, True) if prefix_text else []
        prompts = []
        for choice in choices:
            ids = endpoint.tokenize(prefix_text + choice, True)
            prompts.append(ChoicePrompt(ids, min(_common_prefix_len(prefix, ids), len(ids) - 1)))
        return prompts

    @staticmethod
    def _unconditional(endpoint: Endpoint, prompts: list[ChoicePrompt]) -> list[ChoicePrompt]:
        """The same choice tokens (split as in context) after nothing but a start-of-text token,
        so every one of them, the first included, gets a logprob to normalise by."""
        info = endpoint.model_info
        bos = info["special_tokens"].get("bos_token")
        start: list[int] = endpoint.tokenize(bos)[:1] if bos else info["eos_token_ids"][:1]
        return [ChoicePrompt(start + ids[first:], len(start)) for ids, first in prompts]

    @staticmethod
    def _logprobs(endpoint: Endpoint, prompts: list[ChoicePrompt]) -> list[list[float]]:
        """Logprob of each prompt's tokens from its start position on: one scoring request per
        prompt, sent together, so the runtime prefills their shared prefix once."""
        outs = endpoint.generate(
            input_ids=[ids for ids, _ in prompts],
            sampling_params=[
                {
                    "max_new_tokens": 0,
                    "return_logprob": True,
                    "logprob_start_len": max(first - 1, 0),
                }
                for _, first in prompts
            ],
        )
        assert isinstance(outs, list), "a batch of prompts, a list of results"
        # the first entry is the token at logprob_start_len, with None (SGLang's convention)
        return [[lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]] for out in outs]

    def _role_expr(self, r: Role) -> None:
        if r.part in ("whole", "begin"):
            if self._role is not None:
                raise ValueError(f"{r.role} role opened inside the open {self._role[0]} role")
            if not self._messages and r.role != "system":
                self._append(self.template.default_system)
            self._append(self.template.prefix(r.role))
            self._role = (r.role, len(self._text))
        if r.part == "whole":
            self._run(r.content)
        if r.part in ("whole", "end"):
            if self._role is None or self._role[0] != r.role:
                raise ValueError(f"{r.role}_end() without {r.role}_begin()")
            self._messages.append({"role": r.role, "content": self._text[self._role[1] :]})
            self._role = None
            self._append(self.template.suffix(r.role))

    @contextmanager
    def _scoped_role(self, role: str) -> Iterator[ProgramState]:
        self._role_expr(Role(role, "begin"))
        yield self
        self._role_expr(Role(role, "end"))

    def system(self) -> AbstractContextManager[ProgramState]:
        return self._scoped_role("system")

    def user(self) -> AbstractContextManager[ProgramState]:
        return self._scoped_role("user")

    def assistant(self) -> AbstractContextManager[ProgramState]:
        return self._scoped_role("assistant")

    @contextmanager
    def var_scope(self, name: str) -> Iterator[ProgramState]:
        """Everything appended inside the block becomes variable `name` too."""
        start = len(self._text)
        yield self
        self._set(name, self._text[start:], None)

    def _end_of_turn_ids(self, endpoint: Endpoint) -> list[int]:
        suffix = self.template.suffix("assistant").strip()
        return endpoint.tokenize(suffix)[:1] if suffix else []

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta

    # ---- reading -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        self._wait()
        return self.variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> Any:
        self._wait()
        return self.meta.get(name)

    def text(self) -> str:
        self._wait()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self._wait()
        return list(self._messages)

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """Text as it is produced (a streamed run); only variable `var`'s when given."""
        if self._stream is None:
            yield self.variables[var] if var else self.text()
            return
        while (item := self._stream.get()) is not _End.END:
            if var is None or item[0] == var:
                yield item[1]
        self._wait()

    async def text_async_iter(self, var: str | None = None) -> AsyncIterator[str]:
        import asyncio

        chunks = self.text_iter(var)
        while (chunk := await asyncio.to_thread(next, chunks, _End.END)) is not _End.END:
            yield chunk

    def _wait(self) -> None:
        if threading.get_ident() != self._runner:  # the program itself reads what it has so far
            self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"the program failed: {self._error}") from self._error

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()
        if self._stream is not None:
            self._stream.put(_End.END)

    # ---- forks -------------------------------------------------------------------------------
    def fork(self, n: int) -> ForkGroup:
        """n copies of this state that share its KV: the prefix is prefilled once and pinned in
        the runtime's cache until the group is joined or garbage-collected (unless nothing of it
        is still cached when the pin is asked for, which the runtime refuses: the copies then
        run unpinned)."""
        pin_id = None
        if self._text and not isinstance(self.backend, OpenAI):  # an OpenAI server has no pins
            self.backend.generate(self._text, {"max_new_tokens": 0})
            pin_id = f"fork-{uuid.uuid4().hex}"
            try:
                self.backend.pin(pin_id, self._text)
            except InvalidRequestError:  # evicted already: a pin of nothing holds nothing
                pin_id = None
        children = []
        for _ in range(n):
            child = ProgramState(self.backend, self.template, self.defaults)
            child._text, child.variables, child.meta = (
                self._text,
                dict(self.variables),
                dict(self.meta),
            )
            child._messages, child._role = list(self._messages), self._role
            child._done.set()
            children.append(child)
        return ForkGroup(self, children, pin_id)


class ForkGroup:
    def __init__(self, parent: ProgramState, children: list[ProgramState], pin_id: str | None):
        self.parent, self.children = parent, children
        backend = parent.backend  # a fork pins on a radixrt backend only
        self._unpin = (
            weakref.finalize(self, _unpin, backend, pin_id)
            if pin_id and not isinstance(backend, OpenAI)
            else None
        )

    def __getitem__(self, i: int) -> ProgramState:
        return self.children[i]

    def __len__(self) -> int:
        return len(self.children)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.children)

    def __iadd__(self, expr: Any) -> ForkGroup:
        """One expression for all, a list (one each), or a function of the branch index."""
        if isinstance(expr, list) and len(expr) == len(self.children):
            exprs = expr
        elif callable(expr):
            exprs = [expr(i) for i in range(len(self.children))]
        else:
            exprs = [expr] * len(self.children)
        with ThreadPoolExecutor(len(self.children)) as pool:
            list(pool.map(lambda pair: pair[0]._run(pair[1]), zip(self.children, exprs)))
        return self

    def join(self) -> None:
        """Release the shared prefix; each variable the branches made lands in the parent as a list."""
        names = {k for c in self.children for k in c.variables if k not in self.parent.variables}
        for name in names:
            self.parent.variables[name] = [c.variables.get(name) for c in self.children]
            self.parent.meta[name] = [c.meta.get(name) for c in self.children]
        if self._unpin is not None:
            self._unpin()


def _unpin(backend: Endpoint, pin_id: str) -> None:
    try:
        backend.unpin(pin_id)
    except Exception:  # the runtime is gone: nothing left to release
        pass


class ChoicePrompt(NamedTuple):
    """A select choice as a scoring prompt: token ids, and where the choice's own tokens start."""

    ids: list[int]
    first: int


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _typed(text: str, dtype: Any) -> Any:
    if dtype in (int, "int"):
        return int(text.strip())
    if dtype in (float, "float"):
        return float(text.strip())
    if dtype in (bool, "bool"):
        return text.strip().lower() == "true"
    if dtype in (str, "str") and text.startswith('"'):
        return json.loads(text)  # the str dtype generates a JSON string literal
    return text


def run_program(
    func: Callable[..., Any],
    backend: Backend,
    template: ChatTemplate,
    defaults: dict[str, Any],
    kwargs: dict[str, Any],
    stream: bool,
) -> ProgramState:
    state = ProgramState(backend, template, defaults, stream=stream)

    def body() -> None:
        state._runner = threading.get_ident()
        try:
            state.ret_value = func(state, **kwargs)
            state._finish()
        except BaseException as e:  # surfaced from state[...] / text() / run
            state._finish(e)

    if stream:
        threading.Thread(target=body, daemon=True, name="radixrt-program").start()
    else:
        body()
    return state
