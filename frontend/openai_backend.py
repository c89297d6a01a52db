"""`rt.OpenAI`: DSL programs against any OpenAI-compatible server, through the `openai` package.

Such a server sees text and messages, never token ids or KV pins, so programs run with these
differences from a radixrt backend (`RuntimeEndpoint`, `Runtime`, `Engine`):
- A chat model (the default) gets the program's roles as messages: `gen` must open an assistant
  turn (`rt.assistant(rt.gen(...))`) and becomes one `/v1/chat/completions` request. A completion
  model (`is_chat_model=False`) gets the program's text (roles rendered with `chat_template`, if
  given) through `/v1/completions`.
- `select` on a completion model scores every choice in one `/v1/completions` request with
  `echo` and `logprobs` (the prompt's token logprobs), so it picks as a radixrt backend does; on a
  chat model it decodes under a JSON schema whose only values are the choices (`response_format`),
  which is a constrained greedy pick, not a scored one (meta info `method: "constrained"`).
  A server that cannot do either gets a `SelectUnsupported` naming what was missing.
- `fork` copies the state (no prefix is pinned); `run_batch` and streaming work as usual.
- Sampling fields outside OpenAI's API (`top_k`, `min_p`, `stop_token_ids`, `ignore_eos`,
  `regex`, a `dtype`'s regex) are sent as extra body fields by SGLang's names; a server that does
  not know one should refuse it (radixrt does, naming the field).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple, overload

from radixrt.structured.regexes import DTYPE_REGEXES

from .chat_template import ChatTemplate
from .primitives import Select

# the runtime's sampling params that OpenAI's API names (runtime name -> OpenAI name)
STANDARD = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
}
# the ones it does not: sent as extra body fields under SGLang's (and vLLM's) names
EXTRA = (
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "regex",
    "ebnf",
    "lark",  # radixrt's own (SGLang and vLLM take GBNF only)
    "repetition_penalty",
)
CHOICE_SCHEMA_NAME = "choice"
CHOICE_MAX_TOKENS = 256  # room for `{"choice":"..."}` around the longest reasonable choice


class SelectUnsupported(RuntimeError):
    """`select` needs prompt logprobs (`echo`) or a JSON-schema constraint the server lacks."""


class ProgramPrompt(NamedTuple):
    """A program's state as an OpenAI request sees it: its text (roles rendered), the finished
    messages, and the open role with the text it has so far (None when no role is open)."""

    text: str
    messages: list[dict[str, str]]
    role: str | None
    role_text: str


class OpenAI:
    """A DSL backend for an OpenAI-compatible server at `base_url` serving `model` (see the module
    docstring for what differs from a radixrt backend). `api_key` defaults to `$OPENAI_API_KEY`;
    `chat_template` (Jinja, for a completion model) renders roles into the text, and
    `special_tokens` fills its variables (`bos_token`, ...); other keywords go to
    `openai.OpenAI` (`timeout`, `max_retries`, ...)."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool = True,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        **client_kwargs: Any,
    ):
        import openai  # optional: only this backend needs it

        if is_chat_model and chat_template is not None:
            raise ValueError("chat_template is for a completion model: a chat server renders roles")
        self.model = model
        self.is_chat_model = is_chat_model
        self.client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
            **client_kwargs,
        )
        self.model_info: dict[str, Any] = {
            "chat_template": chat_template,
            "special_tokens": dict(special_tokens or {}),
            "eos_token_ids": [],
        }
        # a completion model's assistant turn ends where the template closes it
        self._turn_end = ChatTemplate.from_model_info(self.model_info).suffix("assistant").strip()

    # ---- gen ---------------------------------------------------------------------------------
    @overload
    def generate(
        self, prompt: ProgramPrompt, sampling_params: dict[str, Any], stream: Literal[False] = False
    ) -> dict[str, Any]: ...

    @overload
    def generate(
        self, prompt: ProgramPrompt, sampling_params: dict[str, Any], stream: Literal[True]
    ) -> Iterator[dict[str, Any]]: ...

    def generate(
        self, prompt: ProgramPrompt, sampling_params: dict[str, Any], stream: bool = False
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """One gen: `{"text", "meta_info"}`, or with `stream` chunks `{"delta", "finished"}`, the
        last one (`finished: True`) with the result, as `RuntimeEndpoint.generate` gives them."""
        body = self._body(prompt, sampling_params)
        start = time.monotonic()
        if not stream:
            reply = self._create(body)
            choice = reply.choices[0]
            meta = _meta(reply.id, reply.usage, choice.finish_reason, time.monotonic() - start)
            if choice.logprobs is not None:
                meta["output_token_logprobs"] = _output_logprobs(choice.logprobs)
            return {"text": self._text_of(choice), "meta_info": meta}
        return self._stream(body, start)

    def _stream(self, body: dict[str, Any], start: float) -> Iterator[dict[str, Any]]:
        pieces, finish, usage, reply_id = [], None, None, None
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for chunk in self._create(stream_body):
            reply_id, usage = chunk.id, chunk.usage or usage
            if chunk.choices:
                delta = self._delta_of(chunk.choices[0])
                finish = chunk.choices[0].finish_reason or finish
                if delta:
                    pieces.append(delta)
                    yield {"delta": delta, "finished": False}
        meta = _meta(reply_id, usage, finish, time.monotonic() - start)
        yield {"text": "".join(pieces), "meta_info": meta, "delta": "", "finished": True}

    def _body(self, prompt: ProgramPrompt, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        body: dict[str, Any] = {"model": self.model}
        extra: dict[str, Any] = {}
        dtype = params.pop("dtype", None)
        if dtype is not None:
            params["regex"] = DTYPE_REGEXES[dtype]
        schema = params.pop("json_schema", None)
        logprobs, top = params.pop("return_logprob", None), params.pop("top_logprobs_num", None)
        for key, value in params.items():
            if key in STANDARD:
                body[STANDARD[key]] = value
            elif key in EXTRA:
                extra[key] = value
            else:
                raise ValueError(f"rt.OpenAI cannot send sampling parameter {key!r}")
        if self.is_chat_model:
            body["messages"] = _chat_messages(prompt)
            if schema is not None:
                body["response_format"] = _schema_format(schema)
            if logprobs or top:
                body["logprobs"], body["top_logprobs"] = True, top
        else:
            body["prompt"] = prompt.text
            body["stop"] = self._stops(prompt, body.get("stop"))
            if schema is not None:
                extra["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
            if logprobs or top:
                body["logprobs"] = top or 0
        if extra:
            body["extra_body"] = extra
        return {k: v for k, v in body.items() if v is not None}

    def _stops(self, prompt: ProgramPrompt, stop: str | list[str] | None) -> list[str] | None:
        """A completion model's stops: the gen's, and the end of the open assistant turn."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if prompt.role == "assistant" and self._turn_end and self._turn_end not in stops:
            stops.append(self._turn_end)
        return stops or None

    def _create(self, body: dict[str, Any]) -> Any:
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        return api.create(**body)

    def _text_of(self, choice: Any) -> str:
        return (choice.message.content or "") if self.is_chat_model else choice.text

    def _delta_of(self, choice: Any) -> str:
        return (choice.delta.content or "") if self.is_chat_model else choice.text

    # ---- select ------------------------------------------------------------------------------
    def select(self, prompt: ProgramPrompt, sel: Select) -> tuple[int, dict[str, Any]]:
        """The index of the chosen choice and the meta info (see the module docstring)."""
        if sel.method == "unconditional":
            raise SelectUnsupported(
                "choices_method='unconditional' needs the server's start-of-text token, which "
                "rt.OpenAI does not know"
            )
        if self.is_chat_model:
            return self._constrained_select(prompt, sel)
        return sel.pick(self._choice_logprobs(prompt.text, sel.choices))

    def _choice_logprobs(self, prefix: str, choices: list[str]) -> list[list[float]]:
        """Each choice's token logprobs after `prefix`, from one echoed completions request; a
        token counts as the choice's when it holds any of the choice's characters."""
        import openai

        try:
            reply = self.client.completions.create(
                model=self.model,
                prompt=[prefix + c for c in choices],
                max_tokens=0,
                echo=True,
                logprobs=0,
                temperature=0,
            )
        except openai.BadRequestError as e:  # 400: the server does not take these fields
            raise SelectUnsupported(
                f"select scores choices with completions echo+logprobs, which {self.model!r} "
                f"refused: {e}"
            ) from e
        by_index = sorted(reply.choices, key=lambda c: c.index)
        return [
            _choice_span(prefix, prefix + c, choice.logprobs)
            for c, choice in zip(choices, by_index)
        ]

    def _constrained_select(self, prompt: ProgramPrompt, sel: Select) -> tuple[int, dict[str, Any]]:
        body = self._body(
            prompt, {"temperature": sel.temperature, "max_new_tokens": CHOICE_MAX_TOKENS}
        )
        reply = self._create({**body, "response_format": _choice_format(sel.choices)})
        text = self._text_of(reply.choices[0])
        try:
            index = sel.choices.index(json.loads(text)[CHOICE_SCHEMA_NAME])
        except (ValueError, KeyError, TypeError) as e:
            raise SelectUnsupported(
                f"select on a chat model decodes under response_format json_schema; {self.model!r}"
                f" answered {text!r}, not one of {sel.choices}: it does not honour that schema"
            ) from e
        return index, {"choices": sel.choices, "method": "constrained"}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> OpenAI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _chat_messages(prompt: ProgramPrompt) -> list[dict[str, str]]:
    """The messages of a chat gen, which must open an assistant turn (the server writes turns
    whole); text outside roles has no message to go in and is refused."""
    if prompt.role != "assistant" or prompt.role_text:
        raise ValueError(
            "on a chat model (rt.OpenAI), gen must be the first thing in an assistant role: "
            "s += rt.assistant(rt.gen(...)); use is_chat_model=False to continue text"
        )
    in_roles = sum(len(m["content"]) for m in prompt.messages)
    if in_roles != len(prompt.text):
        raise ValueError("on a chat model (rt.OpenAI), every piece of text must be in a role")
    return prompt.messages


def _schema_format(schema: str | dict[str, Any]) -> dict[str, Any]:
    schema = json.loads(schema) if isinstance(schema, str) else schema
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _choice_format(choices: list[str]) -> dict[str, Any]:
    """A JSON object whose one field is one of the choices (an object: strict servers want one)."""
    schema = {
        "type": "object",
        "properties": {CHOICE_SCHEMA_NAME: {"type": "string", "enum": choices}},
        "required": [CHOICE_SCHEMA_NAME],
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": CHOICE_SCHEMA_NAME, "schema": schema, "strict": True},
    }


def _choice_span(prefix: str, full: str, logprobs: Any) -> list[float]:
    """The logprobs of the echoed tokens that overlap `full[len(prefix):]`."""
    if logprobs is None or not logprobs.tokens or logprobs.text_offset[0] != 0:
        raise SelectUnsupported("the server did not echo the prompt's token logprobs")
    span = [
        lp
        for tok, offset, lp in zip(logprobs.tokens, logprobs.text_offset, logprobs.token_logprobs)
        if offset < len(full) and offset + len(tok) > len(prefix) and lp is not None
    ]
    if not span:
        raise SelectUnsupported("the server's echoed tokens do not cover the choice")
    return span


def _meta(reply_id: str | None, usage: Any, finish: str | None, latency: float) -> dict[str, Any]:
    """The runtime's meta-info names, from an OpenAI reply's id, usage and finish reason."""
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "id": reply_id,
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "cached_tokens": getattr(details, "cached_tokens", None) or 0,
        "finish_reason": {"type": finish or "stop", "matched": None},
        "e2e_latency": latency,
    }


def _output_logprobs(logprobs: Any) -> list[tuple[float, str]]:
    """(logprob, token text) per generated token; OpenAI servers give text, not token ids."""
    if getattr(logprobs, "content", None) is not None:  # chat
        return [(t.logprob, t.token) for t in logprobs.content]
    return list(zip(logprobs.token_logprobs or [], logprobs.tokens or []))
