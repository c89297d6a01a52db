"""What a program appends to its state: text, gen, select and chat roles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

DTYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool"}


class Expr:
    """Anything appendable; `a + b` makes a sequence appended in order."""

    def __add__(self, other: Any) -> Concat:
        return Concat([self, other])

    def __radd__(self, other: Any) -> Concat:
        return Concat([other, self])


class Concat(list[Any]):
    def __add__(self, other: Any) -> Concat:
        return Concat([*self, other])

    def __radd__(self, other: Any) -> Concat:
        return Concat([other, *self])


@dataclass
class Gen(Expr):
    name: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    choices: list[str] | None = None
    dtype: Any = None
    ebnf: str | None = None  # a GBNF grammar
    lark: str | None = None  # a Lark grammar
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    # tool calls (frontend/tools.py): the variable becomes the parsed calls
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int | None = None  # tokens generated before a stop may end it
    stop_regex: str | list[str] | None = None  # the text ends at a match (SGLang's)
    max_reasoning_tokens: int | None = None  # the reasoning block's bound (--reasoning-parser)

    def sampling_params(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The runtime's sampling params: this gen's values over the run's defaults."""
        params = dict(defaults)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _NOT_SAMPLING:
                continue
            if f.name in ("max_tokens", "min_tokens"):
                params[f.name.replace("tokens", "new_tokens")] = value
            elif f.name == "dtype":
                params["dtype"] = DTYPE_NAMES.get(value, value)
            else:
                params[f.name] = value
        return params


_NOT_SAMPLING = ("name", "tools", "tool_choice", "parallel_tool_calls")
CHOICE_METHODS = ("token_length_normalized", "greedy", "unconditional")


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    method: str = "token_length_normalized"

    def pick(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The best choice's index by `method`, from each choice's token logprobs after the
        prefix (and, for `unconditional`, without it), and the scores as meta info."""
        means = [_mean(lps) for lps in token_logprobs]
        keys: list[tuple[float, ...]] | list[float]
        if self.method == "greedy":
            keys = [tuple(lps) for lps in token_logprobs]  # compared first token first
        elif self.method == "unconditional":
            keys = [m - _mean(a) for m, a in zip(means, unconditional or [])]
        else:
            keys = means
        best = max(range(len(keys)), key=keys.__getitem__)
        return best, {
            "choices": self.choices,
            "method": self.method,
            "normalized_logprobs": means,
            "token_logprobs": token_logprobs,
        }


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


@dataclass
class Role(Expr):
    role: str
    part: str  # "whole", "begin" or "end"
    content: list[Any] = field(default_factory=list)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: list[str] | None = None,
    dtype: Any = None,
    ebnf: str | None = None,
    lark: str | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    stop_regex: str | list[str] | None = None,
    max_reasoning_tokens: int | None = None,
) -> Gen | Select:
    """Generate text into variable `name`. With `choices`, the same as `select`. With `tools`
    (OpenAI's function tools), the reply decodes under the tool-call constraint of `tool_choice`
    (`auto` by default, `required`, `none` or a function's name) and `name` holds the parsed
    calls, `[{"name", "arguments"}]`; the meta info adds the reply's `content`. `logit_bias`:
    token id -> a bias in [-100, 100] added to its logit. `ebnf` (GBNF, llama.cpp's dialect) and
    `lark` constrain the text to a context-free grammar. `min_tokens` and `stop_regex` as in
    SGLang's `gen`. On a server with `--reasoning-parser`, a constraint applies after the
    reasoning block, which `max_reasoning_tokens` bounds."""
    if choices is not None and regex is None and json_schema is None:
        return Select(name, list(choices), temperature or 0.0)
    return Gen(
        name,
        max_tokens,
        stop,
        stop_token_ids,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        ignore_eos,
        regex,
        json_schema,
        choices,
        dtype,
        ebnf,
        lark,
        return_logprob,
        top_logprobs_num,
        tools,
        {"type": "function", "function": {"name": tool_choice}}
        if tool_choice not in (None, "none", "auto", "required") and isinstance(tool_choice, str)
        else tool_choice,
        parallel_tool_calls,
        logit_bias,
        min_tokens,
        stop_regex,
        max_reasoning_tokens,
    )


def gen_int(name: str | None = None, **kwargs: Any) -> Gen:
    return Gen(name=name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen:
    return Gen(name=name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: str = "token_length_normalized",
) -> Select:
    """Pick a choice by its log-probability after the prefix, all choices scored in one batch:
    `token_length_normalized` (mean token logprob, the default), `greedy` (the choice a greedy
    decoder restricted to the choices would take: best first token, then the next, ...), or
    `unconditional` (mean logprob minus the choice's mean logprob without the prefix)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if choices_method not in CHOICE_METHODS:
        raise ValueError(f"choices_method must be one of {CHOICE_METHODS}")
    return Select(name, list(choices), temperature, choices_method)


def _role(role: str) -> tuple[Callable[..., Role], Callable[[], Role], Callable[[], Role]]:
    def whole(*content: Any) -> Role:
        return Role(role, "whole", list(content))

    def begin() -> Role:
        return Role(role, "begin")

    def end() -> Role:
        return Role(role, "end")

    return whole, begin, end


system, system_begin, system_end = _role("system")
user, user_begin, user_end = _role("user")
assistant, assistant_begin, assistant_end = _role("assistant")
