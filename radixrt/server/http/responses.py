"""Response bodies and server-sent events in OpenAI's shapes, built from the runtime's results."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ResponseShape:
    """What differs between chat and text completions."""

    chat: bool
    tokenizer: Any
    logprobs: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    def choice(
        self, index: int, text: str, meta: dict[str, Any], stream: bool = False
    ) -> dict[str, Any]:
        """A finished sample; in a stream its text already went out as deltas."""
        if self.chat:
            body = {"delta": {}} if stream else {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": "" if stream else text}
        return {
            "index": index,
            **body,
            "logprobs": self._logprobs(meta) if self.logprobs else None,
            "finish_reason": meta["finish_reason"]["type"],
        }

    def delta(self, index: int, text: str, first: bool = False) -> dict[str, Any]:
        if self.chat:
            body = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
        else:
            body = {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": None}

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's logprobs of a sample, from the runtime's [logprob, token id] pairs."""
        decode = self.tokenizer.decode
        chosen = [(decode([tid]), lp) for lp, tid in meta["output_token_logprobs"]]
        tops = [
            [(decode([tid]), lp) for lp, tid in top] for top in meta.get("output_top_logprobs", [])
        ]
        if self.chat:

            def entry(token: str, logprob: float) -> dict[str, Any]:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {
                "content": [
                    {**entry(*c), "top_logprobs": [entry(*t) for t in top]}
                    for c, top in zip(chosen, tops or [[]] * len(chosen))
                ]
            }
        offsets = list(itertools.accumulate((len(t) for t, _ in chosen), initial=0))[:-1]
        return {
            "tokens": [t for t, _ in chosen],
            "token_logprobs": [lp for _, lp in chosen],
            "text_offset": offsets,
            "top_logprobs": [dict(top) for top in tops] if tops else None,
        }


def usage_of(samples: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Usage over prompts (each counted once) and all their samples."""
    firsts = [s[0]["meta_info"] for s in samples]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(
        s["meta_info"]["completion_tokens"] for per_prompt in samples for s in per_prompt
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def response_body(
    shape: ResponseShape,
    rid: str,
    model: str,
    choices: list,
    usage: dict | None = None,
    chunk: bool = False,
) -> dict[str, Any]:
    body = {
        "id": rid,
        "object": shape.chunk_object if chunk else shape.object,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    return body if usage is None else {**body, "usage": usage}


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
