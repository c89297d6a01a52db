"""`HttpEndpoint`, what `rt.RuntimeEndpoint("http://...")` (`connect`) gives: the same user API
over the gateway's HTTP routes.

SGLang's native `/generate` carries generation (a batch in one call, so a `select` scores every
choice in one round trip; `stream` as SSE), `/tokenize`, `/get_model_info`, `/get_server_info`
(its `internal_states[0]` is `stats()`) and `/flush_cache` the rest; a `fork`'s pins go through
radixrt's `/pin` and `/unpin` (docs/protocol.md, "The native HTTP API"). Results have the ZeroMQ
endpoint's shapes (logprobs as `[logprob, token_id]` pairs), so programs cannot tell the two
apart. Only the standard library: one HTTP connection per call, any thread.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass, field
from http.client import HTTPResponse
from typing import Any, Literal, overload

from radixrt.client.base import (
    Chunk,
    Endpoint,
    Params,
    Prompt,
    Prompts,
    RequestOptions,
    Result,
    Results,
    TokenIds,
    normalize_prompt,
)
from radixrt.client.transport import raise_for
from radixrt.protocol import ADMIN_KEYED_OPS, ControlOp, ErrorCode

# an HTTP status -> the error code of an answer that names none (a proxy's, a plain 404)
STATUS_CODES = {
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.INVALID_REQUEST,
    413: ErrorCode.INVALID_REQUEST,
    422: ErrorCode.INVALID_REQUEST,
    429: ErrorCode.RATE_LIMITED,
    503: ErrorCode.OVERLOADED,
    504: ErrorCode.TIMEOUT,
}
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")


@dataclass
class _StreamState:
    """What one sample's cumulative SSE events have said so far, to hand out deltas."""

    text: str = ""
    ids: list[int] = field(default_factory=list)


class HttpEndpoint(Endpoint):
    """What `rt.RuntimeEndpoint(url)` is for an `http://` or `https://` url: `api_key` is sent as
    `Authorization: Bearer`, `admin_api_key` instead on the control ops and on those of which
    the admin sees more (`stats`, `model_info`, ...: `protocol.ADMIN_KEYED_OPS`); `timeout`
    bounds each call (seconds; None waits)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float | None = None,
        curve_server_key: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        admin_api_key: str | None = None,
        curve_client_secret_key: str | None = None,
        lora_path: str | None = None,
    ):
        if curve_server_key or curve_client_secret_key:
            raise ValueError("CURVE keys are for tcp:// and ipc:// urls; use https:// for TLS")
        super().__init__(url.rstrip("/"), timeout, cache_salt, priority, lora_path)
        self.api_key, self.admin_api_key = api_key, admin_api_key

    # ---- generation --------------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        stream: Literal[False] = False,
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Results: ...

    @overload
    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        *,
        stream: Literal[True],
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Generator[Chunk, None, None]: ...

    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        stream: bool = False,
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Results | Generator[Chunk, None, None]:
        """As `RuntimeEndpoint.generate`, in one `/generate` call."""
        items, single, key = normalize_prompt(prompt, input_ids)
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        )
        if len(params) != len(items):
            raise ValueError("sampling_params must be one value or one per prompt")
        opts = (options or RequestOptions()).over(self.options)
        body = {
            key: items[0] if single else items,
            "sampling_params": (params[0] or {}) if single else [p or {} for p in params],
            **opts.wire(),  # the key goes as the bearer token
        }
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        if stream:
            if not single:
                raise ValueError("stream=True takes one prompt")
            return self._stream({**body, "stream": True}, opts.api_key)
        outs = self._post("/generate", body, opts.api_key)
        outs = outs if isinstance(outs, list) else [outs]
        grouped = _group(outs, [max(1, (p or {}).get("n") or 1) for p in params])
        return grouped[0] if single else grouped

    async def async_generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        options: RequestOptions | None = None,
    ) -> Results:
        return await asyncio.to_thread(
            self.generate, prompt, sampling_params, input_ids, rid, False, options
        )

    async def async_stream(
        self,
        prompt: Prompt | None = None,
        sampling_params: Params | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        options: RequestOptions | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        chunks = self.generate(
            prompt, sampling_params, input_ids, rid, stream=True, options=options
        )
        try:
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield chunk
        finally:
            chunks.close()

    def abort(self, rid: str) -> None:
        """Abort request `rid` of this key; one no longer in flight is no error."""
        try:
            self._post("/abort_request", {"rid": rid}, None)
        except ValueError:  # 404: it finished meanwhile
            pass

    def _stream(self, body: dict[str, Any], api_key: str | None) -> Generator[Chunk, None, None]:
        """The SSE events of a streamed /generate as the ZeroMQ endpoint's chunks: deltas
        `{"index", "finished": False, "delta", "token_ids"}`, then each sample's final map."""
        states: dict[int, _StreamState] = {}
        with self._open("/generate", body, api_key) as reply:
            for line in reply:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                _raise_for_body(event, 200)
                index = event.get("index", 0)
                state = states.setdefault(index, _StreamState())
                if event["meta_info"].get("finish_reason") is not None:
                    yield {"index": index, "finished": True, **_sample(event)}
                    continue
                delta, ids = event["text"][len(state.text) :], event["output_ids"][len(state.ids) :]
                state.text, state.ids = event["text"], event["output_ids"]
                yield {"index": index, "finished": False, "delta": delta, "token_ids": ids}

    # ---- control ops -------------------------------------------------------------------------
    def control(self, op: ControlOp) -> Any:
        """`op` over its route (`/<op>`, `protocol.Route`), its answer read back to the op's
        result; an op without a route is the runtime's alone (NotImplementedError)."""
        if op.route is None:
            raise NotImplementedError(f"{op.op} is a ZeroMQ op: use the server's --zmq-port")
        key = self.admin_api_key if op.op in ADMIN_KEYED_OPS else self.api_key
        path = f"/{op.op}"
        if op.route.method == "GET":
            answer = self._get(path, key)
        else:
            answer = self._post(path, op.fields(), key)
        return op.route.reply.result_of(answer)

    def stats(self) -> dict[str, Any]:
        state: dict[str, Any] = self._get("/get_server_info", self.admin_api_key)[
            "internal_states"
        ][0]
        return state

    def metrics(self) -> str:
        """The server's Prometheus text (`GET /metrics`: the gateway's counts, then the runtime's)."""
        with self._open("/metrics", None, self.admin_api_key) as reply:
            return reply.read().decode()

    def flush_cache(self) -> bool:
        """True once flushed; False while requests run (the route's 400)."""
        try:
            flushed: bool = self._post("/flush_cache", {}, self.admin_api_key)["success"]
            return flushed
        except _NotFlushed:
            return False

    def health(self, timeout: float | None = None) -> bool:
        self._get("/health", None, timeout)
        return True

    def pin(self, pin_id: str, prompt: Prompt, options: RequestOptions | None = None) -> int:
        key = "text" if isinstance(prompt, str) else "input_ids"
        opts = (options or RequestOptions()).over(self.options)
        salt = {"cache_salt": opts.cache_salt} if opts.cache_salt is not None else {}
        body = {"pin_id": pin_id, key: prompt, **salt}
        pinned: int = self._post("/pin", body, opts.api_key)["pinned_tokens"]
        return pinned

    def unpin(self, pin_id: str) -> bool:
        unpinned: bool = self._post("/unpin", {"pin_id": pin_id}, None)["success"]
        return unpinned

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        ids: list[int] = self._post("/tokenize", body, None)["tokens"]
        return ids

    def _fetch_model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._get("/get_model_info", self.admin_api_key)
        return info

    def close(self) -> None:
        """Nothing to close: each call has its own connection."""

    # ---- plumbing ----------------------------------------------------------------------------
    def _get(self, path: str, api_key: str | None, timeout: float | None = None) -> Any:
        with self._open(path, None, api_key, timeout) as reply:
            return json.loads(reply.read())

    def _post(self, path: str, body: dict[str, Any], api_key: str | None) -> Any:
        with self._open(path, body, api_key) as reply:
            return json.loads(reply.read())

    def _open(
        self,
        path: str,
        body: dict[str, Any] | None,
        api_key: str | None,
        timeout: float | None = None,
    ) -> HTTPResponse:
        """The open reply of one call; an error status raised as the ZeroMQ client raises it."""
        key = api_key or self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(f"{self.url}{path}", data, headers)
        try:
            reply: HTTPResponse = urllib.request.urlopen(request, timeout=timeout or self.timeout)
            return reply
        except urllib.error.HTTPError as e:
            with e:
                text = e.read()
            try:
                answer = json.loads(text)
            except ValueError:
                answer = {"error": {"message": text.decode(errors="replace")}}
            if path == "/flush_cache" and e.code == 400 and answer.get("success") is False:
                raise _NotFlushed() from None
            _raise_for_body(answer, e.code)
            raise ConnectionError(f"{path}: HTTP {e.code}") from None
        except urllib.error.URLError as e:
            raise ConnectionError(f"cannot reach {self.url}: {e.reason}") from None


class _NotFlushed(Exception):
    """/flush_cache answered 400: requests are running."""


def _raise_for_body(answer: Any, status: int) -> None:
    """Raise the `RemoteError` an error answer stands for: its `code` when it is a runtime
    error code, else the one its HTTP status implies."""
    if not isinstance(answer, dict) or "error" not in answer:
        return
    error = answer["error"] if isinstance(answer["error"], dict) else {"message": answer["error"]}
    code = error.get("code")
    if ErrorCode.parse(code) is None:
        fallback = STATUS_CODES.get(status, ErrorCode.INTERNAL_ERROR)
        code = fallback.value if status >= 400 else ErrorCode.INTERNAL_ERROR.value
    raise_for({"error": {"code": code, "message": error.get("message", "")}})


def _sample(body: dict[str, Any]) -> dict[str, Any]:
    """A native sample as the ZeroMQ endpoint returns it: logprobs as `[logprob, token_id]`."""
    meta = dict(body["meta_info"])
    for key in LOGPROB_KEYS:
        if key in meta:
            meta[key] = [[lp, tid] for lp, tid, *_ in meta[key]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:  # a row is null at the first prompt token
            meta[key] = [
                top if top is None else [[lp, tid] for lp, tid, *_ in top] for top in meta[key]
            ]
    sample = {"text": body["text"], "output_ids": body["output_ids"], "meta_info": meta}
    if "embedding" in body:  # an --is-embedding server's vector
        sample["embedding"] = body["embedding"]
    return sample


def _group(bodies: list[dict[str, Any]], counts: list[int]) -> list[Result | list[Result]]:
    """The flat list of samples as one result per prompt (a list where its n > 1)."""
    out: list[Result | list[Result]] = []
    start = 0
    for n in counts:
        samples = [_sample(b) for b in bodies[start : start + n]]
        out.append(samples[0] if n == 1 else samples)
        start += n
    return out
