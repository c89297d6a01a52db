"""The request bodies of /v1/completions and /v1/chat/completions, and how they become prompts and
sampling parameters for the runtime."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixrt.client.endpoint import Prompt
from radixrt.server.http.errors import APIError
from radixrt.structured.regexes import JSON_OBJECT_REGEX


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerateRequest(BaseModel):
    model: str | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # radixrt's own (docs/protocol.md): the cache namespace, the scheduling priority, a deadline
    cache_salt: str | None = None
    priority: int | None = None
    timeout: float | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The runtime validates the values (docs/protocol.md); unset ones keep its defaults."""
        given = {
            k: getattr(self, k)
            for k in (
                "n",
                "stop",
                "temperature",
                "top_p",
                "seed",
                "frequency_penalty",
                "presence_penalty",
            )
        }
        return {
            "max_new_tokens": max_new_tokens,
            **{k: v for k, v in given.items() if v is not None},
        }


class CompletionRequest(GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the template may use them
    role: str
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


def render_chat(tokenizer, messages: list[dict[str, Any]]) -> str:
    """Messages -> the prompt text, with the model's own chat template, ready for the assistant."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def message_dict(m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        if any(part.get("type") != "text" for part in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        message["content"] = "".join(str(part.get("text", "")) for part in m.content)
    return message


def constraint_params(fmt: ResponseFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"regex": JSON_OBJECT_REGEX}
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise APIError(
            400,
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format",
        )
    return {"json_schema": schema}


def prompt_list(prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompt
