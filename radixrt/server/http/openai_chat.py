"""OpenAI's completions and chat completions (`/v1/completions`, `/v1/chat/completions`):
`ChatAPI` over the gateway's shared steps (the request's options, a chat's plan, the stream), its
replies in OpenAI's shapes (`shapes.py`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixrt.client.endpoint import Prompt, RequestOptions
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.gateway import (
    MAX_FANOUT,
    Gateway,
    Model,
    event_stream,
    prompt_bytes,
    unless_disconnected,
)
from radixrt.server.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    prompt_list,
)
from radixrt.server.http.shapes import (
    ChoiceStream,
    Echo,
    ResponseShape,
    response_body,
    sse_event,
    usage_of,
)

ROUTES = ("/v1/completions", "/v1/chat/completions")


class ChatAPI:
    """The two routes' handlers (Ray Serve's ingress calls them too)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def complete(self, request: Request, req: CompletionRequest) -> Response:
        model = await self.gateway.model()
        params = req.sampling_params(req.max_tokens)
        if req.logprobs is not None:
            params.update(return_logprob=True, top_logprobs_num=req.logprobs)
        shape = ResponseShape(
            chat=False, tokenizer=model.tokenizer, logprobs=req.logprobs is not None
        )
        prompts = prompt_list(req.prompt)
        if not req.echo:
            return await self._respond(request, req, model, prompts, params, shape)
        # echoed prompts go as the ids the echo shows, so each echoed logprob has its token
        self.gateway.check_prompt_bytes(sum(prompt_bytes(p) for p in prompts), "prompt")
        echoes = await self.gateway.cpu.run(lambda: [Echo.of(model.tokenizer, p) for p in prompts])
        if req.logprobs is not None:
            params["logprob_start_len"] = 0
        ids: list[Prompt] = [e.ids for e in echoes]
        return await self._respond(request, req, model, ids, params, shape, echoes)

    async def chat(self, request: Request, req: ChatCompletionRequest) -> Response:
        model = await self.gateway.model()
        plan = await self.gateway.chat_plan(model, req)
        return await self._respond(request, req, model, [plan.prompt], plan.params, plan.shape)

    async def _respond(
        self,
        request: Request,
        req: GenerateRequest,
        model: Model,
        prompts: list[Prompt],
        params: dict[str, Any],
        shape: ResponseShape,
        echoes: list[Echo] | None = None,
    ) -> Response:
        """`echoes`: each prompt's echo (completions with `echo: true`)."""
        rid = f"{shape.id_prefix}{uuid.uuid4().hex}"
        fanout = len(prompts) * max(1, params.get("n") or 1)
        if fanout > MAX_FANOUT:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n makes {fanout} requests; at most {MAX_FANOUT} per call",
                param="prompt",
            )
        if req.stream:
            if len(prompts) != 1:
                raise APIError(400, "stream: true takes one prompt", param="prompt")
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            echo = echoes[0] if echoes else None
            return await self._stream(
                request, rid, model, prompts[0], params, shape, include_usage, req, echo
            )
        options = await self.gateway.options(request, req)
        samples = await unless_disconnected(
            request, [self._generate(p, params, options) for p in prompts]
        )
        choices = [
            shape.choice(
                i * len(per_prompt) + j,
                s["text"],
                s["meta_info"],
                echo=echoes[i] if echoes else None,
            )
            for i, per_prompt in enumerate(samples)
            for j, s in enumerate(per_prompt)
        ]
        return JSONResponse(response_body(shape, rid, model.name, choices, usage_of(samples)))

    async def _generate(
        self, prompt: Prompt, params: dict[str, Any], options: RequestOptions
    ) -> list[dict[str, Any]]:
        out = await self.gateway.endpoint.async_generate(prompt, params, options=options)
        return out if isinstance(out, list) else [out]

    async def _stream(
        self,
        request: Request,
        rid: str,
        model: Model,
        prompt: Prompt,
        params: dict[str, Any],
        shape: ResponseShape,
        include_usage: bool,
        req: GenerateRequest,
        echo: Echo | None = None,
    ) -> StreamingResponse:
        options = await self.gateway.options(request, req)
        return await event_stream(
            request,
            lambda: self.gateway.endpoint.async_stream(prompt, params, options=options),
            lambda replies: self._events(
                rid, model.name, replies, shape, params.get("n", 1), include_usage, echo
            ),
        )

    async def _events(
        self,
        rid: str,
        model: str,
        replies: AsyncIterator[dict[str, Any]],
        shape: ResponseShape,
        n: int,
        include_usage: bool,
        echo: Echo | None = None,
    ) -> AsyncIterator[str]:
        """The stream's events; a completion's `echo` is each sample's first text."""
        # A client that disconnects cancels this generator inside `replies`, which aborts the request.
        if echo is not None:
            for i in range(n):
                yield sse_event(
                    response_body(shape, rid, model, [shape.delta(i, echo.text)], chunk=True)
                )
        if shape.chat:
            yield sse_event(
                response_body(
                    shape,
                    rid,
                    model,
                    [shape.delta(i, "", first=True) for i in range(n)],
                    chunk=True,
                )
            )
        finals = []
        streams = {i: ChoiceStream.of(shape) for i in range(n)}

        def chunk(choice: dict[str, Any]) -> str:
            return sse_event(response_body(shape, rid, model, [choice], chunk=True))

        try:
            async for reply in replies:
                index = reply.get("index", 0)
                text = "" if reply["finished"] else reply["delta"]  # a final reply has no delta
                for delta in streams[index].feed(text, final=reply["finished"]):
                    yield chunk(shape.delta(index, delta))
                if reply["finished"]:
                    finals.append(reply)
                    called = streams[index].called
                    yield chunk(shape.choice(index, "", reply["meta_info"], True, called))
        except RUNTIME_EXCEPTIONS as e:
            yield sse_event(from_runtime_error(e).body())
            return
        if include_usage:
            finals.sort(key=lambda r: r.get("index", 0))
            yield sse_event(
                response_body(shape, rid, model, [], usage=usage_of([finals]), chunk=True)
            )
        yield "data: [DONE]\n\n"


def add_chat_routes(app: FastAPI, gateway: Gateway) -> None:
    api = ChatAPI(gateway)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await api.complete(request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(request, req)
