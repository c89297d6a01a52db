"""The request bodies of /v1/completions and /v1/chat/completions, and how they become prompts and
sampling parameters for the runtime."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from inspect import signature
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from radixrt.client.chat_render import DEFAULT_MAX_CHARS, RenderJob, render
from radixrt.client.endpoint import Prompt
from radixrt.protocol import GenerateOptions, option_fields, spec_of
from radixrt.sampling_params import OPENAI_CONSTRAINTS, SamplingParams, openai_names, param_spec
from radixrt.server.http.errors import APIError
from radixrt.structured.patterns import Constraint
from radixrt.structured.regexes import JSON_OBJECT_LARK
from radixrt.structured.tools import (
    Tool,
    ToolCallParser,
    ToolChoice,
    ToolError,
    parse_tool_choice,
    parse_tools,
    prompt_messages,
    template_renders_tools,
)


class Body(BaseModel):
    """A request body: a field it does not declare is refused by name (a 400 from `build_app`'s
    validation handler), never dropped, so a client learns what this server does not do."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: bool = False


def request_body(
    base: type[BaseModel],
    *,
    native: bool,
    options: type[GenerateOptions] = GenerateOptions,
    sampling: type[SamplingParams] | None = SamplingParams,
) -> type[BaseModel]:
    """A body class under `base` holding the fields a request body takes from the declarations
    (docs/protocol.md's tables), each optional (None: not sent): for the OpenAI bodies, the
    request fields they carry and the sampling parameters under their names there; for the
    native /generate (`native`), every request field (a per-prompt one as one value or a list
    of them) and the sampling parameters it takes top level. `sampling` None: no sampling
    parameters (a body that generates nothing: /v1/embeddings)."""
    params = _param_fields(sampling, native) if sampling is not None else {}
    fields = {**_option_fields(options, native), **params}
    name = f"{'Native' if native else 'OpenAI'}{'' if sampling else 'Option'}Fields"
    return create_model(name, __base__=base, **fields)


def _option_fields(options: type[GenerateOptions], native: bool) -> dict[str, Any]:
    hints = get_type_hints(options)
    return {
        f.name: (_optional(hints[f.name], native and spec_of(f).per_prompt), None)
        for f in option_fields(options)
        if native or spec_of(f).openai
    }


def _param_fields(sampling: type[SamplingParams], native: bool) -> dict[str, Any]:
    hints, fields = get_type_hints(sampling), {}
    for f in dataclasses.fields(sampling):
        spec = param_spec(f)
        if native:
            name = f.name if spec.native else None
        else:
            name = spec.openai
        if name is not None:
            fields[name] = (_optional(spec.body or hints[f.name], False), None)
    return fields


def _optional(hint: Any, per_prompt: bool) -> Any:
    """`T | None`, or `T | list[T] | None` for a per-prompt field."""
    kinds = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    value: Any = Union[tuple(k for k in kinds if k is not type(None))]  # noqa: UP007
    return value | list[value] | None if per_prompt else value | None


# the request fields and sampling parameters of the OpenAI bodies (`cache_salt`, `temperature`,
# `min_tokens`, ...)
OpenAIFields = request_body(Body, native=False)


class GenerateRequest(OpenAIFields):  # type: ignore[misc,valid-type]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's fields that change nothing here: accepted knowingly, and ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The runtime validates the values (docs/protocol.md); unset ones keep its defaults."""
        given = {k: getattr(self, name) for k, name in openai_names().items()}
        return {
            "max_new_tokens": max_new_tokens,
            **{k: v for k, v in given.items() if v is not None},
        }


class CompletionRequest(GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (with `logprobs`, its tokens' too)


class CalledFunction(Body):
    name: str
    # JSON text as the model wrote it (OpenAI's), or the object itself
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(Body):
    """One call of an assistant message's `tool_calls` (OpenAI's shape), checked here so that a
    history the template or the tool-call writer cannot read is a 400, not a failure inside."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template may use them
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # checked by structured.tools.parse_tools, for its messages
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the reply continues the last (assistant) message instead of starting a new one
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template


# what transformers' renderer passes the template beside the caller's variables (its
# render_jinja_template arguments, the messages, and the helpers templates call)
TEMPLATE_OWN_NAMES = frozenset(
    {"conversations", "messages", "raise_exception", "strftime_now", "kwargs"}
)


@dataclass(frozen=True)
class ChatRendering:
    """How the messages become a prompt, beyond the messages and tools themselves."""

    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, req: ChatCompletionRequest, tokenizer: Any) -> ChatRendering:
        """400 for a `chat_template_kwargs` key that is one of apply_chat_template's own
        arguments or a name the renderer gives the template itself (it would override how the
        prompt is built, not feed the template)."""
        kwargs = req.chat_template_kwargs or {}
        own = {*signature(tokenizer.apply_chat_template).parameters, *TEMPLATE_OWN_NAMES}
        reserved = sorted(set(kwargs) & own)
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {reserved}: they are not template variables",
                param="chat_template_kwargs",
                code="invalid_request",
            )
        return cls(req.continue_final_message, kwargs)


def chat_job(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    rendering: ChatRendering = ChatRendering(),
    max_bytes: int = DEFAULT_MAX_CHARS,
) -> RenderJob:
    """What `tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)` renders,
    as a job a render process can run without the tokenizer: its template for these tools
    (transformers' choice), its special tokens (the template's variables, under the caller's
    `chat_template_kwargs`), and an output limit of `max_bytes`. A ValueError when the
    tokenizer has no template."""
    specials = {
        k: v if isinstance(v, (str, list)) else str(v)
        for k, v in tokenizer.special_tokens_map.items()
    }
    return RenderJob(
        template=tokenizer.get_chat_template(None, tools),
        messages=messages,
        tools=tools,
        variables={**specials, **rendering.template_kwargs},
        add_generation_prompt=not rendering.continue_final_message,
        continue_final_message=rendering.continue_final_message,
        max_bytes=max_bytes,
    )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    rendering: ChatRendering = ChatRendering(),
) -> str:
    """Messages -> the prompt text, with the model's own chat template, ready for the assistant
    (or, with `continue_final_message`, inside its last message); `tools` go to a template that
    renders them (structured.tools.prompt_messages did the rest). Rendered in this process, as
    the gateway's render processes render it (`chat_job`; the bench's prompts)."""
    return render(chat_job(tokenizer, messages, tools, rendering))


def message_dict(m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        if any(part.get("type") != "text" for part in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        message["content"] = "".join(str(part.get("text", "")) for part in m.content)
    return message


def add_constraint(params: dict[str, Any], constraint: dict[str, Any], param: str) -> None:
    """Add one more source's constraint to the sampling params; 400 when they already hold one
    (`regex` or `json_schema` given in the body): one reply decodes under one constraint."""
    if constraint and any(params.get(k) is not None for k in OPENAI_CONSTRAINTS):
        raise APIError(
            400,
            f"{param} cannot be combined with {', '.join(OPENAI_CONSTRAINTS)}: give one constraint",
            param=param,
            code="invalid_request",
        )
    params.update(constraint)


def constraint_params(fmt: ResponseFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"lark": JSON_OBJECT_LARK}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise APIError(
            400,
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format",
        )
    return {"json_schema": schema}


@dataclass(frozen=True)
class ChatTools:
    """A chat request's tools: what goes into the prompt, the regex the reply decodes under
    (None: unconstrained), and the parser that reads calls from the reply (None under `none`)."""

    tools: list[Tool]
    choice: ToolChoice
    constraint: Constraint | None
    reply_parser: ToolCallParser | None

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: ToolCallParser) -> ChatTools:
        """400 for malformed tools or tool_choice, or tool calls together with response_format."""
        try:
            tools = parse_tools(req.tools or [])
        except ToolError as e:
            raise APIError(400, str(e), param="tools", code="invalid_request") from None
        try:
            choice = parse_tool_choice(req.tool_choice, tools)
        except ToolError as e:
            raise APIError(400, str(e), param="tool_choice", code="invalid_request") from None
        constraint = parser.constraint(tools, choice, req.parallel_tool_calls)
        if constraint is not None and req.response_format not in (
            None,
            ResponseFormat(type="text"),
        ):
            raise APIError(
                400,
                "response_format cannot be combined with tool calls (use tool_choice: none)",
                param="response_format",
                code="invalid_request",
            )
        return cls(tools, choice, constraint, parser if choice.mode != "none" else None)

    def messages(
        self, messages: list[dict[str, Any]], parser: ToolCallParser, template: str | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages for the chat template, and the tools it renders itself (if it does)."""
        rendered = [t.to_openai() for t in self.tools] if template_renders_tools(template) else None
        try:
            return prompt_messages(messages, self.tools, parser, template), rendered or None
        except ToolError as e:
            raise APIError(400, str(e), param="messages", code="invalid_request") from e


def prompt_list(prompt: str | list[Any]) -> list[Prompt]:
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompt
