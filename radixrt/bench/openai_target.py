"""Any OpenAI-compatible server (vLLM, SGLang, llama-server, radixrt's own gateway) behind the
bench's `generate(prompt, params, stream=True)`, so the same loads and metrics measure it.

A request is one streamed `POST /v1/completions` of the workload's prompt text (a chat
session's history rendered by the bench's tokenizer, as vLLM's `openai` backend sends raw
prompts). A streamed piece with text counts as one token for the timings (its ids are not on the
wire: the map carries one placeholder id, as vLLM's benchmark counts a piece); the final usage
gives the prompt, cached and completion token counts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from radixrt.bench.load import REPLY_TIMEOUT_S

# the workloads' radixrt sampling params that OpenAI's completions API names itself
OPENAI_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "stop": "stop"}


def openai_base_url(url: str) -> str:
    """The API root the `openai` client takes: `url` itself when it ends in /v1, else
    `url` + /v1 (a server's root is what people copy)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class OpenAITarget:
    """One OpenAI-compatible server. `model` is the name requests send (default: the first
    of its `/v1/models`); the key is `api_key`, else `$OPENAI_API_KEY`, else a placeholder."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None):
        import openai

        self.client = openai.OpenAI(
            base_url=openai_base_url(base_url),
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
            timeout=REPLY_TIMEOUT_S,
            max_retries=0,  # a refused request is a result, not something to hide
        )
        self.model = model or self.client.models.list().data[0].id

    def generate(
        self, prompt: str, params: dict[str, Any], stream: bool = True
    ) -> Iterator[dict[str, Any]]:
        """Stream one completion as the bench's chunk maps: one per piece with text, then the
        final map with the usage; an error raises (the load records it on the request)."""
        known = {OPENAI_PARAMS[k]: v for k, v in params.items() if k in OPENAI_PARAMS}
        extra = {k: v for k, v in params.items() if k not in OPENAI_PARAMS}  # SGLang's names
        response = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **known,
        )
        pieces, usage, finish = [], None, "length"
        for chunk in response:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.text:
                    pieces.append(choice.text)
                    yield {"finished": False, "delta": choice.text, "token_ids": [0]}
                finish = choice.finish_reason or finish
        completion = usage.completion_tokens if usage else len(pieces)
        details = getattr(usage, "prompt_tokens_details", None)
        yield {
            "finished": True,
            "text": "".join(pieces),
            "output_ids": [0] * completion,
            "meta_info": {
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "cached_tokens": (details.cached_tokens or 0) if details else 0,
                "finish_reason": {"type": finish},
            },
        }
