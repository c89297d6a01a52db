"""`rt.RuntimeEndpoint` and `connect(url)`: the user API of a running runtime (blocking, streaming
and asyncio) over its ZeroMQ socket (`ZmqEndpoint`, here) or its HTTP API (`HttpEndpoint`,
client/http.py), siblings over `client.base.Endpoint`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

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
)
from radixrt.client.http import HttpEndpoint
from radixrt.client.transport import AsyncSubmission, RuntimeClient, Submission
from radixrt.protocol import ControlOp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Endpoint", "Prompt", "RequestOptions", "RuntimeEndpoint", "ZmqEndpoint", "connect"]

S = TypeVar("S", Submission, AsyncSubmission)


class ZmqEndpoint(Endpoint):
    """An `Endpoint` over the ZeroMQ socket of `radixrt serve` (`tcp://host:zmq_port` or
    `ipc://path`); thread-safe, any number of requests in flight over one socket. `api_key` and
    `curve_server_key` (the server's Z85 public key) match the server's `--api-key` (or a key of
    `--api-key-file`) and `--curve-secret-key`; `admin_api_key` (the server's `--admin-api-key`)
    is sent instead with control ops (`flush_cache`, `check_invariants`, `memory_snapshot`,
    `shutdown`) and with the ops of which the admin sees more (`stats`, `model_info`,
    `list_lora_adapters`: `protocol.ADMIN_KEYED_OPS`); `curve_client_secret_key` is this
    client's CURVE secret key, for a server whose `--curve-client-keys` lists its public key
    (default: an ephemeral key pair).
    `max_frame_bytes` (the server's `--max-frame-bytes`) refuses a request that packs larger
    before it is sent (`FrameTooLargeError`), where the server would drop the connection."""

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
        max_frame_bytes: int | None = None,
    ):
        super().__init__(url, timeout, cache_salt, priority, lora_path)
        self.client = RuntimeClient(
            url,
            api_key=api_key,
            curve_server_key=curve_server_key,
            admin_api_key=admin_api_key,
            curve_client_secret_key=curve_client_secret_key,
            max_frame_bytes=max_frame_bytes,
        )

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
        """One prompt -> `{"text", "output_ids", "meta_info"}` (a list of n when n > 1); a list
        of prompts -> a list. With `stream=True` (one prompt), an iterator of chunks
        `{"delta", "token_ids", "index", "finished"}`, the last per sample with the result.
        `lora_path` names the adapter of every prompt, or (a list) of each one."""
        requests, single = self._requests(prompt, input_ids, sampling_params, rid, options)
        requests = _with_adapters(requests, lora_path)
        if stream:
            if not single:
                raise ValueError("stream=True takes one prompt")
            return self.client.submit(**requests[0], stream=True).replies(self.timeout)
        submissions = _submit_all(self.client.submit, requests)
        try:
            outs = [_results(s.finals(self.timeout)) for s in submissions]
        finally:
            for s in submissions:  # one failed: the others are given up (aborted) too
                s.close()
        return outs[0] if single else outs

    async def async_generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        options: RequestOptions | None = None,
    ) -> Results:
        requests, single = self._requests(prompt, input_ids, sampling_params, rid, options)
        submissions = _submit_all(self.client.submit_async, requests)
        try:
            outs = [_results(await s.finals(self.timeout)) for s in submissions]
        finally:
            for s in submissions:  # one failed: the others are given up (aborted) too
                s.close()
        return outs[0] if single else outs

    def async_stream(
        self,
        prompt: Prompt | None = None,
        sampling_params: Params | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        options: RequestOptions | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """`async for chunk in endpoint.async_stream(...)`: the streamed chunks of one prompt."""
        requests, single = self._requests(prompt, input_ids, sampling_params, rid, options)
        if not single:
            raise ValueError("async_stream takes one prompt")
        return self.client.submit_async(**requests[0], stream=True).replies(self.timeout)

    def abort(self, rid: str) -> None:
        self.client.abort(rid)

    # ---- control ops -------------------------------------------------------------------------
    def control(self, op: ControlOp) -> Any:
        fields = op.fields()
        return self.client.call(op.op, self.timeout, **fields)

    def health(self, timeout: float | None = None) -> bool:
        ok: bool = self.client.call("health", timeout if timeout is not None else self.timeout)
        return ok

    def pin(self, pin_id: str, prompt: Prompt, options: RequestOptions | None = None) -> int:
        key = "text" if isinstance(prompt, str) else "input_ids"
        fields = (options or RequestOptions()).over(self.options).pin_fields()
        pinned: int = self.client.call(
            "pin", self.timeout, pin_id=pin_id, **{key: prompt}, **fields
        )
        return pinned

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self.client.call(
            "tokenize", self.timeout, text=text, add_special_tokens=add_special_tokens
        )
        return ids

    def _fetch_model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.client.call("model_info", self.timeout)
        return info

    def close(self) -> None:
        self.client.close()


def connect(url: str, *args: Any, **kwargs: Any) -> Endpoint:
    """The endpoint for `url`: an `HttpEndpoint` for `http://` and `https://`, else a
    `ZmqEndpoint` (`tcp://`, `ipc://`); the other arguments are the endpoint's own."""
    if str(url).startswith(("http://", "https://")):
        return HttpEndpoint(url, *args, **kwargs)
    return ZmqEndpoint(url, *args, **kwargs)


class RuntimeEndpoint(Endpoint):
    """`rt.RuntimeEndpoint(url, ...)` is `connect(url, ...)`: the ZeroMQ or HTTP endpoint for
    the URL, each an instance of this class too (registered), so code written against
    `RuntimeEndpoint` takes either."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Endpoint:  # type: ignore[misc]
        return connect(*args, **kwargs)


RuntimeEndpoint.register(ZmqEndpoint)
RuntimeEndpoint.register(HttpEndpoint)


def _submit_all(submit: Callable[..., S], requests: list[dict[str, Any]]) -> list[S]:
    """Each request submitted; when one cannot be (it does not pack), those before it are
    aborted and the error raised."""
    submissions: list[S] = []
    try:
        for r in requests:
            submissions.append(submit(**r))
    except BaseException:
        for s in submissions:
            s.close()
        raise
    return submissions


def _with_adapters(
    requests: list[dict[str, Any]], lora_path: str | list[str] | None
) -> list[dict[str, Any]]:
    """`requests` each under its adapter: one name for all, or one per request."""
    if lora_path is None:
        return requests
    names = [lora_path] * len(requests) if isinstance(lora_path, str) else lora_path
    if len(names) != len(requests):
        raise ValueError("lora_path must be one name or one per prompt")
    return [{**r, "lora_path": n} for r, n in zip(requests, names)]


def _results(finals: list[dict[str, Any]]) -> Result | list[Result]:
    # `embedding`: an --is-embedding server's vector
    outs: list[Result] = [
        {k: r[k] for k in ("text", "output_ids", "meta_info", "embedding") if k in r}
        for r in finals
    ]
    return outs[0] if len(outs) == 1 else outs


def import_tokenizer_library() -> None:
    """Import what `load_tokenizer` needs (transformers' top level: about half a second, no
    torch), so that a caller can overlap it with waiting for the runtime."""
    import transformers  # noqa: F401


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> list[int]:
    """A text prompt's token ids, the one way every route computes them (`/generate`,
    `/v1/completions`, `/tokenize`, chat, ZeroMQ, the DSL): with the special tokens the model
    asks for (a GGUF's `tokenizer.ggml.add_bos_token`, a tokenizer's `add_bos_token`), as
    llama.cpp's server and SGLang add them to a text prompt, but never a second BOS before a
    text that begins with one (a chat template's `{{ bos_token }}`): the ids then start with
    exactly one, as transformers' `apply_chat_template` gives them. A text's own tokens are
    never dropped: only a BOS the tokenizer itself added."""
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    bos = tokenizer.bos_token_id
    if (
        add_special_tokens
        and bos is not None
        and ids[:2] == [bos, bos]
        and tokenizer.encode("", add_special_tokens=True)[:1] == [bos]
    ):
        del ids[0]
    return ids


def load_tokenizer(info: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The runtime's tokenizer, from its `model_info` as the admin sees it: the files at its
    `tokenizer_path` (the runtime's paths must be this machine's) with the chat template it
    serves, which `--chat-template` may have put in place of the files' own. A tenant's
    `model_info` names no server path: PermissionError.

    The class is the one the runtime's AutoTokenizer chose (`tokenizer_class`), loaded directly:
    AutoTokenizer itself reads the model's config, whose classes import torch (a quarter GB
    resident, seconds) in processes that never run the model. A class transformers does not
    export (remote code) goes through AutoTokenizer."""
    import transformers

    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise PermissionError(
            "model_info names no tokenizer path: the server shows its paths to its admin key only"
        )
    cls = getattr(transformers, info.get("tokenizer_class") or "AutoTokenizer", None)
    load = getattr(cls, "from_pretrained", None) if isinstance(cls, type) else None
    tokenizer: PreTrainedTokenizerBase = (load or transformers.AutoTokenizer.from_pretrained)(path)
    if info.get("chat_template"):
        tokenizer.chat_template = info["chat_template"]
    return tokenizer
