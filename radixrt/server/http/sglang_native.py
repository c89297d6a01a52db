"""SGLang's native HTTP API on the gateway: `/generate`, `/flush_cache`, `/get_model_info`,
`/get_server_info`, `/health_generate`, `/tokenize`, `/detokenize`, `/abort_request`, and
radixrt's `/pin` and `/unpin` (what a DSL `fork` needs over HTTP; SGLang has no equivalent).

Bodies are checked field by field: a field the server does not know is a 400 that names it (the
runtime names an unknown sampling parameter the same way). Each route speaks to the runtime with
the caller's own key, so the runtime's roles decide (a tenant's key cannot flush the cache).
docs/protocol.md ("The native HTTP API") is the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from radixrt import __version__
from radixrt.client.base import Chunk, Params, Prompt, RequestOptions, is_batch
from radixrt.client.endpoint import prompt_ids
from radixrt.protocol import ControlOp, ErrorCode, option_fields, spec_of
from radixrt.sampling_params import SamplingParams, param_spec
from radixrt.server.http.control import CONTROL_ROUTES, add_control_routes
from radixrt.server.http.errors import RUNTIME_EXCEPTIONS, APIError, from_runtime_error
from radixrt.server.http.gateway import (
    MAX_FANOUT,
    Gateway,
    bearer,
    event_stream,
    prompt_bytes,
    unless_disconnected,
)
from radixrt.server.http.pins import MAX_CALLER_PIN_ID_CHARS, runtime_pin_id
from radixrt.server.http.schemas import Body, request_body
from radixrt.server.http.shapes import sse_event

# routes that need an accepted key when keys are set (/health stays open, as on /v1)
KEYED_ROUTES = (
    "/generate",
    "/flush_cache",
    "/get_model_info",
    "/get_server_info",
    "/server_info",
    "/concate_and_append_request",
    "/health_generate",
    "/tokenize",
    "/detokenize",
    "/abort_request",
    "/pin",
    "/unpin",
    *CONTROL_ROUTES,
)
CONTROL_TIMEOUT_S = 30.0
HEALTH_GENERATE_PARAMS = {"max_new_tokens": 1, "temperature": 0}
# the sampling parameters a native /generate takes top level (SGLang's logprob fields); the wire
# carries them in sampling_params
TOP_LEVEL_PARAMS = tuple(f.name for f in dataclasses.fields(SamplingParams) if param_spec(f).native)
# SGLang's /generate fields radixrt cannot serve, each refused by name with why (not as unknown)
UNSERVED_FIELDS = {
    "image_data": "radixrt serves text-only models (no image inputs)",
    "video_data": "radixrt serves text-only models (no video inputs)",
    "audio_data": "radixrt serves text-only models (no audio inputs)",
    "input_embeds": "radixrt takes prompts as text or token ids, not embeddings",
    "custom_logit_processor": "radixrt never runs code a request sends (it would be unpickled)",
    "return_hidden_states": "radixrt does not return hidden states",
    "session_params": "radixrt has no sessions; its radix cache reuses a shared prefix by itself",
}


class NativeGenerateRequest(request_body(Body, native=True)):  # type: ignore[misc]
    """SGLang's `GenerateReqInput`, the fields radixrt serves (one prompt or a batch): with
    the request fields (`GenerateOptions`: `cache_salt`, `priority`, `timeout`, `lora_path`,
    ...) and the sampling parameters it takes top level (`return_logprob`, ...)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_text_in_logprobs: bool = False  # each logprob triple's third item: its token's text

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, body: Any) -> Any:
        unserved = [k for k in UNSERVED_FIELDS if isinstance(body, dict) and k in body]
        if unserved:
            raise ValueError(f"{unserved[0]} is not supported: {UNSERVED_FIELDS[unserved[0]]}")
        return body


class TokenizeRequest(Body):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    tokens: list[int]
    skip_special_tokens: bool = True


class ConcateAndAppendRequest(Body):
    src_rids: list[str]
    dst_rid: str


class AbortRequest(Body):
    rid: str


class PinRequest(Body):
    pin_id: str = Field(max_length=MAX_CALLER_PIN_ID_CHARS)
    text: str | None = None
    input_ids: list[int] | None = None
    cache_salt: str | None = None


class UnpinRequest(Body):
    pin_id: str = Field(max_length=MAX_CALLER_PIN_ID_CHARS)


@dataclass(frozen=True)
class NativeCall:
    """One prompt of a native /generate as the runtime gets it: its own rid there (unique on
    the gateway's one connection), the caller's rid (echoed as `meta_info.id`) and key, the
    prompt and its sampling parameters."""

    runtime_rid: str
    rid: str
    key: str | None  # the caller's (None without keys): rids are the caller's own
    prompt: Prompt
    params: Params
    # this prompt's values of every per-prompt request field the body set (`lora_path`: its
    # adapter)
    own: dict[str, Any] = field(default_factory=dict)

    def with_own(self, options: RequestOptions) -> RequestOptions:
        """The call's options (`Gateway.options`), with this prompt's own values over them: a
        per-prompt field the body gave as a list is never sent whole."""
        return replace(options, **self.own)


def _prompts(req: NativeGenerateRequest) -> tuple[list[Prompt], bool]:
    """The prompts of the body, and whether it named one prompt (answered with one object)."""
    if (req.text is None) == (req.input_ids is None):
        raise _invalid("give exactly one of text or input_ids", "text")
    if isinstance(req.text, str):
        return [req.text], True
    if req.text is not None:
        return list(req.text), False
    assert req.input_ids is not None, "exactly one of the two was given"
    if is_batch(req.input_ids):
        return list(req.input_ids), False
    return [req.input_ids], True


def _calls(req: NativeGenerateRequest, key: str | None) -> tuple[list[NativeCall], bool]:
    prompts, single = _prompts(req)
    if not prompts:
        raise _invalid("the batch is empty", "text" if req.text is not None else "input_ids")
    one = req.sampling_params if isinstance(req.sampling_params, dict) else {}
    params = req.sampling_params if isinstance(req.sampling_params, list) else None
    params = params or [one] * len(prompts)
    rids = [req.rid] if isinstance(req.rid, str) else req.rid
    rids = rids or [uuid.uuid4().hex for _ in prompts]
    if len(params) != len(prompts):
        raise _invalid("sampling_params must be one map or one per prompt", "sampling_params")
    if len(rids) != len(prompts) or len(set(rids)) != len(rids):
        raise _invalid("rid must be one distinct string per prompt", "rid")
    own = _per_prompt_fields(req, len(prompts))
    logprobs = {k: getattr(req, k) for k in TOP_LEVEL_PARAMS if getattr(req, k) is not None}
    return [
        NativeCall(f"native-{uuid.uuid4().hex}", r, key, p, {**sp, **logprobs}, mine)
        for r, p, sp, mine in zip(rids, prompts, params, own)
    ], single


def _per_prompt_fields(req: NativeGenerateRequest, count: int) -> list[dict[str, Any]]:
    """Each prompt's own per-prompt request fields (`FieldSpec.per_prompt`): the body's one
    value for every prompt, or its list, one per prompt; a field not set is left out."""
    own: list[dict[str, Any]] = [{} for _ in range(count)]
    for f in option_fields():
        value = getattr(req, f.name)
        if not spec_of(f).per_prompt or value is None:
            continue
        values = value if isinstance(value, list) else [value] * count
        if len(values) != count:
            raise _invalid(f"{f.name} must be one value or one per prompt", f.name)
        for mine, v in zip(own, values):
            if v is not None:
                mine[f.name] = v
    return own


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=ErrorCode.INVALID_REQUEST.value)


TokenText = Callable[[int], str]


def _triples(pairs: list[list[Any]], text: TokenText | None) -> list[list[Any]]:
    """The runtime's `[logprob, token_id]` as SGLang's `[logprob, token_id, text]`: the token's
    text with `return_text_in_logprobs` (`text` given), else None."""
    return [[lp, tid, text(tid) if text else None] for lp, tid in pairs]


def sample_body(sample: dict[str, Any], rid: str, text: TokenText | None = None) -> dict[str, Any]:
    """One finished sample in SGLang's shape: `text`, `output_ids`, `meta_info` with `id`, its
    logprobs as triples (a top-logprob row that is None, at the first prompt token, stays so)."""
    meta = {**sample["meta_info"], "id": rid}
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = _triples(meta[key], text)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [top if top is None else _triples(top, text) for top in meta[key]]
    return {"text": sample["text"], "output_ids": sample["output_ids"], "meta_info": meta}


class NativeAPI:
    """The native routes over one `Gateway` (radixrt/server/http/app.py); keeps which caller's
    rids are in flight, so `/abort_request` finds them and two callers' rids never meet."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        # (caller's key, caller's rid) -> the runtime's rid: one key's rids never meet another's
        self.in_flight: dict[tuple[str | None, str], str] = {}

    def key_of(self, request: Request) -> str | None:
        """The caller's key when keys are set (the runtime names its tenant and role)."""
        if not self.gateway.keys.keys:
            return None
        return bearer(dict(request.headers.raw)) or None

    def _key_fields(self, request: Request) -> dict[str, str]:
        key = self.key_of(request)
        return {"api_key": key} if key else {}

    async def _call(
        self, request: Request, op: str, wait_s: float = CONTROL_TIMEOUT_S, **fields: Any
    ) -> Any:
        """A control op with the caller's key, its reply awaited `wait_s` seconds at most; its
        error as an HTTP error."""
        try:
            return await asyncio.to_thread(
                self.gateway.endpoint.client.call,
                op,
                wait_s,
                **self._key_fields(request),
                **fields,
            )
        except RUNTIME_EXCEPTIONS as e:
            raise from_runtime_error(e) from e

    # ---- /generate ---------------------------------------------------------------------------
    async def generate(self, request: Request, req: NativeGenerateRequest) -> Response:
        calls, single = _calls(req, self.key_of(request))
        fanout = sum(max(1, c.params.get("n") or 1) for c in calls)
        if fanout > MAX_FANOUT:
            raise _invalid(f"{fanout} requests (prompts x n); at most {MAX_FANOUT} per call")
        options = await self.gateway.options(request, req)
        text = await self._token_text() if req.return_text_in_logprobs else None
        self._claim(calls)
        try:
            if req.stream:
                if not single:
                    raise _invalid("stream: true takes one prompt", "stream")
                return await event_stream(
                    request,
                    lambda: self._stream(calls[0], options),
                    lambda replies: self._events(calls[0], replies, text),
                )
            outs = await unless_disconnected(request, [self._one(c, options, text) for c in calls])
        except BaseException:
            self._release(calls)
            raise
        self._release(calls)
        bodies = [b for per_prompt in outs for b in per_prompt]
        return JSONResponse(bodies[0] if single and len(bodies) == 1 else bodies)

    async def _token_text(self) -> TokenText:
        """A token id's text as `return_text_in_logprobs` shows it (the token decoded alone)."""
        tokenizer = (await self.gateway.model()).tokenizer
        return lambda tid: tokenizer.decode([tid])

    def _claim(self, calls: list[NativeCall]) -> None:
        taken = [c.rid for c in calls if (c.key, c.rid) in self.in_flight]
        if taken:
            raise _invalid(f"rid {taken[0]!r} is already in flight", "rid")
        for c in calls:
            self.in_flight[c.key, c.rid] = c.runtime_rid

    def _release(self, calls: list[NativeCall]) -> None:
        for c in calls:
            self.in_flight.pop((c.key, c.rid), None)

    async def _one(
        self, call: NativeCall, options: RequestOptions, text: TokenText | None
    ) -> list[dict[str, Any]]:
        options = call.with_own(options)
        out = await self.gateway.endpoint.async_generate(
            call.prompt, call.params, rid=call.runtime_rid, options=options
        )
        samples = out if isinstance(out, list) else [out]
        return [sample_body(s, call.rid, text) for s in samples]

    async def _stream(self, call: NativeCall, options: RequestOptions) -> AsyncIterator[Chunk]:
        replies = self.gateway.endpoint.async_stream(
            call.prompt, call.params, rid=call.runtime_rid, options=call.with_own(options)
        )
        try:
            async for reply in replies:
                yield reply
        finally:
            await replies.aclose()  # aborts the request when the caller left early
            self._release([call])

    async def _events(
        self, call: NativeCall, replies: AsyncIterator[Chunk], text: TokenText | None
    ) -> AsyncIterator[str]:
        """SGLang's stream: each event holds the sample's text and ids so far (cumulative), the
        last one its `meta_info` with `finish_reason`; then `data: [DONE]`."""
        n = max(1, call.params.get("n") or 1)
        texts: dict[int, str] = {}
        ids: dict[int, list[int]] = {}
        try:
            async for reply in replies:
                index = reply.get("index", 0)
                if reply["finished"]:
                    body = sample_body(reply, call.rid, text)
                elif reply["delta"] or reply["token_ids"]:
                    texts[index] = texts.get(index, "") + reply["delta"]
                    ids[index] = ids.get(index, []) + list(reply["token_ids"])
                    meta = {"id": call.rid, "finish_reason": None}
                    body = {"text": texts[index], "output_ids": ids[index], "meta_info": meta}
                else:
                    continue
                yield sse_event({**body, "index": index} if n > 1 else body)
        except RUNTIME_EXCEPTIONS as e:
            yield sse_event(from_runtime_error(e).body())
            return
        yield "data: [DONE]\n\n"

    async def abort_request(self, request: Request, req: AbortRequest) -> dict[str, Any]:
        """Abort the caller's request `rid` (another key's rid is not found)."""
        runtime_rid = self.in_flight.get((self.key_of(request), req.rid))
        if runtime_rid is None:
            raise APIError(404, f"no request {req.rid!r} in flight", param="rid")
        self.gateway.endpoint.abort(runtime_rid)
        return {"success": True}

    # ---- control and introspection -----------------------------------------------------------
    async def flush_cache(self, request: Request) -> JSONResponse:
        """200 once flushed; 400 while requests run (SGLang's statuses)."""
        flushed = await self._call(request, "flush_cache")
        message = "cache flushed" if flushed else "cache not flushed: requests are running"
        return JSONResponse({"success": flushed, "message": message}, 200 if flushed else 400)

    async def get_model_info(self, request: Request) -> dict[str, Any]:
        """The runtime's `model_info` (its `weight_version` among them) as the caller's key may
        see it, with SGLang's keys: its frontend reads `model_path` (and guesses a chat template
        from it), which a tenant, who sees no server path, gets as the served model's name."""
        info = await self._call(request, "model_info")
        path = info.get("model_path", info["model"])
        return {
            **info,
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    async def get_server_info(self, request: Request) -> dict[str, Any]:
        """The runtime's `stats` (as the caller's key may see them) as SGLang's
        `internal_states`, beside the model's name and context length."""
        stats = await self._call(request, "stats")
        model = await self.gateway.model()
        return {
            "version": __version__,
            "served_model_name": model.name,
            "context_length": model.context_length,
            "internal_states": [stats],
        }

    async def concate_and_append_request(self, req: ConcateAndAppendRequest) -> dict[str, Any]:
        """SGLang's frontend (`join("concate_and_append")`, and any join under its default
        parallel encoding) asks here to splice forked branches' KV caches after the parent's;
        it has already appended their text itself. radixrt splices nothing: the next request
        sends the joined text, whose K/V the radix cache reuses up to the branches and
        computes after them in full context. So this succeeds doing nothing."""
        return {"success": True}

    async def health_generate(self, request: Request) -> dict[str, Any]:
        """200 once the runtime generated one token."""
        options = RequestOptions(api_key=self.key_of(request))
        try:
            await asyncio.wait_for(
                self.gateway.endpoint.async_generate(
                    "ping", dict(HEALTH_GENERATE_PARAMS), options=options
                ),
                CONTROL_TIMEOUT_S,
            )
        except (TimeoutError, asyncio.TimeoutError, *RUNTIME_EXCEPTIONS) as e:
            raise APIError(503, f"the runtime cannot generate: {e}", "server_error") from e
        return {"status": "ok"}

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """The prompts' ids (at most `--max-prompt-bytes` in all), tokenized on the CPU pool."""
        model = await self.gateway.model()
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        self.gateway.check_prompt_bytes(sum(prompt_bytes(p) for p in prompts), "prompt")

        def encode() -> list[list[int]]:
            special = req.add_special_tokens
            return [prompt_ids(model.tokenizer, p, special) for p in prompts]

        tokens = await self.gateway.cpu.run(encode)
        one = isinstance(req.prompt, str)
        return {
            "tokens": tokens[0] if one else tokens,
            "count": len(tokens[0]) if one else [len(t) for t in tokens],
            "max_model_len": model.context_length,
        }

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """The ids' text (at most `--max-prompt-bytes` of ids, 4 bytes each), on the CPU pool."""
        model = await self.gateway.model()
        self.gateway.check_prompt_bytes(prompt_bytes(req.tokens), "tokens")
        vocabulary = len(model.tokenizer)
        if any(not 0 <= t < vocabulary for t in req.tokens):
            raise _invalid("a token id is outside the vocabulary", "tokens")
        text = await self.gateway.cpu.run(
            model.tokenizer.decode, req.tokens, skip_special_tokens=req.skip_special_tokens
        )
        return {"text": text}

    async def pin(self, request: Request, req: PinRequest) -> dict[str, Any]:
        """Keep the cached prefix of the prompt from eviction until `/unpin` or the end of the
        caller's lease (docs/protocol.md): the pin is the caller's own (its id scoped by its
        key, sent with its key) and counts among its MAX_PINS_PER_CALLER."""
        if (req.text is None) == (req.input_ids is None):
            raise _invalid("give exactly one of text or input_ids", "text")
        prompt: dict[str, Any] = (
            {"text": req.text} if req.text is not None else {"input_ids": req.input_ids}
        )
        salt: dict[str, Any] = {"cache_salt": req.cache_salt} if req.cache_salt is not None else {}
        lease = self.gateway.pins.claim(self.key_of(request), req.pin_id)
        try:
            pinned = await self._call(request, "pin", pin_id=lease.runtime_id, **prompt, **salt)
        except BaseException:
            self.gateway.pins.release(lease.runtime_id)
            raise
        return {"pinned_tokens": pinned, "lease_s": self.gateway.pins.lease_s}

    async def unpin(self, request: Request, req: UnpinRequest) -> dict[str, Any]:
        runtime_id = runtime_pin_id(self.key_of(request), req.pin_id)
        self.gateway.pins.release(runtime_id)
        return {"success": await self._call(request, "unpin", pin_id=runtime_id)}

    async def control(self, request: Request, op: ControlOp) -> Any:
        """A control op's result (`server/http/control.py`'s routes)."""
        fields = op.fields()
        return await self._call(request, op.op, op.wait_s or CONTROL_TIMEOUT_S, **fields)


def add_native_routes(app: FastAPI, gateway: Gateway) -> None:
    native = NativeAPI(gateway)

    @app.post("/generate")
    async def generate(req: NativeGenerateRequest, request: Request) -> Response:
        return await native.generate(request, req)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest, request: Request) -> dict[str, Any]:
        return await native.abort_request(request, req)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await native.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return await native.detokenize(req)

    @app.post("/pin")
    async def pin(req: PinRequest, request: Request) -> dict[str, Any]:
        return await native.pin(request, req)

    @app.post("/unpin")
    async def unpin(req: UnpinRequest, request: Request) -> dict[str, Any]:
        return await native.unpin(request, req)

    @app.post("/flush_cache")  # a control op: POST, its body (if any) an empty JSON object
    async def flush_cache(request: Request, req: Body | None = None) -> JSONResponse:
        return await native.flush_cache(request)

    app.get("/get_model_info")(native.get_model_info)
    app.get("/get_server_info")(native.get_server_info)
    app.get("/server_info")(native.get_server_info)  # SGLang's newer name

    @app.post("/concate_and_append_request")
    async def concate_and_append_request(req: ConcateAndAppendRequest) -> dict[str, Any]:
        return await native.concate_and_append_request(req)

    app.get("/health_generate")(native.health_generate)
    add_control_routes(app, native.control)
