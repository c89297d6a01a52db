"""What a user would pick instead of radixrt, run on the same weights: transformers `generate`
(batched, padded), and llama.cpp on the same GGUF file two ways: through llama-cpp-python's
high-level API (one request at a time) and as its own server, `llama-server` (parallel slots
with continuous batching)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixrt.bench.metrics import RequestTrace
from radixrt.bench.workloads import Session

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LLAMA_CPP_MISSING = (
    "llama.cpp skipped: llama-cpp-python is not installed (`make bench-peers` installs it; "
    "it compiles llama.cpp, which takes several minutes)"
)
LLAMA_SERVER_MISSING = (
    "llama-server skipped: no llama-server in $RADIXRT_LLAMA_CPP_TOOLS, beside this Python or "
    "on PATH (`make bench-peers` builds it, about 7 minutes)"
)
LLAMA_SERVER_START_S = 120


def run_transformers(
    model_dir: Path,
    sessions: list[Session],
    tokenizer: PreTrainedTokenizerBase,
    dtype: str,
    batch_size: int = 64,
) -> tuple[list[RequestTrace], float]:
    """Batches of single-turn prompts through one padded `generate` each, as a script without a
    serving engine would; each request's tokens are credited at the step that produced them."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class _StepClock(StoppingCriteria):
        """Records when each generation step ends; never stops generation."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(
            self, ids: torch.LongTensor, scores: tuple[torch.Tensor] | None, **kwargs: Any
        ) -> torch.BoolTensor:
            self.times.append(time.monotonic())
            # torch's stubs give every factory's result the class Tensor, whatever its dtype
            return torch.zeros(ids.shape[0], dtype=torch.bool)  # type: ignore[return-value]

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32
    )
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves PreTrainedModel.eval unannotated
    traces: list[RequestTrace] = []
    start = time.monotonic()
    for first in range(0, len(sessions), batch_size):
        batch = sessions[first : first + batch_size]
        prompts = [tokenizer.encode(s.turns[0].text, add_special_tokens=False) for s in batch]
        lengths = [s.turns[0].params["max_new_tokens"] for s in batch]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sent = time.monotonic()
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max(lengths),
                min_new_tokens=max(lengths),
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        step_times = clock.times
        for p, n in zip(prompts, lengths):
            traces.append(
                RequestTrace(
                    sent=sent,
                    chunk_times=step_times[:n],
                    chunk_tokens=[1] * n,
                    done=step_times[n - 1],
                    prompt_tokens=len(p),
                    forward_passes=n,
                )
            )
    return traces, time.monotonic() - start


class LlamaCppTarget:
    """llama.cpp behind the same `generate(prompt, params, stream=True)` as radixrt's backends.
    It serves one request at a time (others queue), reusing the KV of the previous prompt's
    common prefix as llama-cpp-python does."""

    def __init__(self, gguf: Path, context_length: int = 8192, threads: int | None = None):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf), n_ctx=context_length, n_threads=threads, verbose=False
        )
        self.lock = threading.Lock()

    def generate(
        self, prompt: str, params: dict[str, Any], stream: bool = True
    ) -> Iterator[dict[str, Any]]:
        with self.lock:
            ids = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
            bias = {self.llm.token_eos(): float("-inf")} if params.get("ignore_eos") else None
            count, text = 0, ""
            for piece in self.llm.create_completion(
                ids,
                max_tokens=params["max_new_tokens"],
                temperature=params.get("temperature", 0),
                logit_bias=bias,
                stream=True,
            ):
                count += 1
                delta = piece["choices"][0]["text"]
                text += delta
                yield {"finished": False, "delta": delta, "token_ids": [0]}
            yield {
                "finished": True,
                "text": text,
                "output_ids": [0] * count,
                "meta_info": {
                    "prompt_tokens": len(ids),
                    "cached_tokens": 0,
                    "forward_passes": count,
                    "finish_reason": {"type": "length"},
                },
            }

    def close(self) -> None:
        self.llm.close()


class LlamaServerTarget:
    """llama.cpp's own server behind the same `generate(prompt, params, stream=True)`: `slots`
    parallel sequences (`-np`) batched continuously, each slot with `context_length` tokens and
    its own prompt cache, on every core; with `slots` None, llama-server's own defaults (`-m`
    alone). Tokens stream over its HTTP API (`POST /completion`)."""

    def __init__(self, binary: Path, gguf: Path, slots: int | None, context_length: int = 2048):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        sized: list[str] = []
        if slots is not None:
            sized = ["-np", str(slots), "-c", str(context_length * slots)]
            sized += ["-t", str(os.cpu_count() or 1), "--cont-batching"]
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)] + sized,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + LLAMA_SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready after {LLAMA_SERVER_START_S} s")

    def next_token(self, ids: list[int]) -> int:
        """llama.cpp's greedy next token after the token ids `ids` (its prompt cache reused from
        call to call: teacher forcing a text costs a token a call)."""
        body = {"prompt": ids, "n_predict": 1, "samplers": ["top_k"], "top_k": 1}
        body |= {"cache_prompt": True, "return_tokens": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server: HTTP {response.status} {response.read()[:200]!r}")
        token: int = json.loads(response.read())["tokens"][0]
        return token

    def generate(
        self, prompt: str, params: dict[str, Any], stream: bool = True
    ) -> Iterator[dict[str, Any]]:
        body = {
            "prompt": prompt,
            "n_predict": params["max_new_tokens"],
            "temperature": params.get("temperature", 0),
            "ignore_eos": bool(params.get("ignore_eos")),
            "cache_prompt": True,
            "stream": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server: HTTP {response.status} {response.read()[:200]!r}")
        count, text = 0, ""
        last: dict[str, Any] = {}  # the latest event
        for line in response:
            if not line.startswith(b"data: "):
                continue
            last = json.loads(line[len(b"data: ") :])
            if last.get("content"):
                count += 1
                text += last["content"]
                yield {"finished": False, "delta": last["content"], "token_ids": [0]}
            if last.get("stop"):
                break
        conn.close()
        yield {
            "finished": True,
            "text": text,
            "output_ids": [0] * last.get("tokens_predicted", count),
            "meta_info": {
                "prompt_tokens": last.get("tokens_evaluated", 0),
                "cached_tokens": 0,  # its tokens_cached counts the slot's whole cache, not reuse
                "forward_passes": count,
                "finish_reason": {"type": "length"},
            },
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def llama_cpp_converter() -> Path | None:
    """llama.cpp's converter's folder (convert_hf_to_gguf.py, conversion/, gguf-py/):
    $RADIXRT_LLAMA_CPP_CONVERTER (where `make test` fetches it, outside the checkout), else the
    newest in the cache dir; None where there is none."""
    places = _llama_cpp_places("RADIXRT_LLAMA_CPP_CONVERTER", "llama.cpp-converter-*")
    return next((p for p in places if (p / "convert_hf_to_gguf.py").is_file()), None)


def llama_cpp_tool(name: str) -> Path | None:
    """One of llama.cpp's tools (`llama-server`, `llama-bench`, `test-backend-ops`, ...): in
    $RADIXRT_LLAMA_CPP_TOOLS (where `make bench-peers` and `make test` build them, outside the
    checkout), the newest in the cache dir, beside this Python, or on PATH; None where none is."""
    places = _llama_cpp_places("RADIXRT_LLAMA_CPP_TOOLS", "llama.cpp-*/bin")
    for place in [*places, Path(sys.executable).parent]:
        if (place / name).is_file() and os.access(place / name, os.X_OK):
            return place / name
    found = shutil.which(name)
    return Path(found) if found else None


def _llama_cpp_places(variable: str, pattern: str) -> list[Path]:
    """The folder $`variable` names, then the cache dir's folders matching `pattern`, newest
    version first."""
    from radixrt.executor.model_loader import cache_dir

    places = sorted(cache_dir().glob(pattern), reverse=True)
    if os.environ.get(variable):
        places.insert(0, Path(os.environ[variable]))
    return places


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True
