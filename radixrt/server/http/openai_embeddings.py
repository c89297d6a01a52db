"""`POST /v1/embeddings` (OpenAI's), served by an `--is-embedding` runtime: each input is a
prompt-only request through the same scheduler and prefix cache, whose reply carries the pooled
vector (`models/pooling.py`). `dimensions` truncates a Matryoshka model's vector (renormalized
where the model normalizes); `encoding_format: base64` sends little-endian float32 bytes, as
OpenAI does and its SDK asks by default. A server that does not embed refuses the route by name."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import Field

from radixrt.protocol import ErrorCode
from radixrt.server.http.errors import APIError
from radixrt.server.http.gateway import MAX_FANOUT, Gateway, unless_disconnected
from radixrt.server.http.schemas import Body, prompt_list, request_body

# the request fields (cache_salt, priority, timeout, ...) an OpenAI body carries
OptionFields = request_body(Body, native=False, sampling=None)


class EmbeddingRequest(OptionFields):  # type: ignore[misc,valid-type]
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and unused, as OpenAI's


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code=ErrorCode.INVALID_REQUEST.value)


def _size(pooling: dict[str, Any], dimensions: int | None) -> int:
    """The vector length a request gets: the model's, or `dimensions` where it may truncate."""
    if dimensions is None:
        return int(pooling["size"])
    sizes = pooling["matryoshka"]
    if sizes is None:
        raise _bad(
            "dimensions", "dimensions: this model's vectors cannot be truncated (not Matryoshka)"
        )
    if dimensions > pooling["size"] or (sizes and dimensions not in sizes):
        allowed = sizes or f"1 to {pooling['size']}"
        raise _bad("dimensions", f"dimensions must be one of {allowed}, got {dimensions}")
    return dimensions


def _vector(values: list[float], size: int, pooling: dict[str, Any], fmt: str) -> Any:
    vector = np.asarray(values[:size], dtype=np.float32)
    if size < len(values) and pooling["normalize"]:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embed(gateway: Gateway, request: Request, req: EmbeddingRequest) -> dict[str, Any]:
    model = await gateway.model()
    if model.embedding is None:
        raise _bad(
            "model", "this server generates and does not embed: start it with --is-embedding"
        )
    size = _size(model.embedding, req.dimensions)
    prompts = prompt_list(req.input)
    if len(prompts) > MAX_FANOUT:
        raise _bad("input", f"at most {MAX_FANOUT} inputs a request, got {len(prompts)}")
    if any(not p for p in prompts):
        raise _bad("input", "an input must not be empty")
    options = await gateway.options(request, req)
    ids = [p for p in prompts if isinstance(p, list)]
    texts: list[str | list[int]] = [p for p in prompts if isinstance(p, str)]
    generate = gateway.endpoint.async_generate(
        texts or None, {"max_new_tokens": 0}, input_ids=ids or None, options=options
    )
    (outs,) = await unless_disconnected(request, [generate])
    outs = outs if isinstance(outs, list) else [outs]
    tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _vector(o["embedding"], size, model.embedding, req.encoding_format),
        }
        for i, o in enumerate(outs)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def add_embedding_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await embed(gateway, request, req)
