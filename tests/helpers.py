"""Helpers shared by tests: transformers references and prompt sets."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq

from radixrt.server.front import PROBE

from ownership import assert_all_free, assert_slot_ownership
from timeouts import REPLY_TIMEOUT_S

DATA = Path(__file__).resolve().parent / "data"  # texts, datasets and tasks the tests read

# The shape of every tiny random checkpoint the tests make (the default model's vocabulary, so
# its tokenizer fits): each test adds what its family or case needs.
TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.4,
    bos_token_id=1,
    eos_token_id=2,
)


@lru_cache(maxsize=4)
def float_checkpoint(gguf: Path) -> Path:
    """A GGUF's folder (`convert_gguf`: config, tokenizer, the marker naming the file) with the
    file's weights beside it as float32 safetensors, as `GGUFWeightReader` reads them (equal to
    transformers' own GGUF load): what transformers' references load. Kept in the cache dir by
    content, made once (a temporary name, renamed: two xdist workers may both make it)."""
    import shutil

    from transformers import AutoConfig

    from radixrt.executor.model_loader import (
        SKELETON_FILE,
        GGUFWeightReader,
        SafetensorsWriter,
        cache_dir,
        resolve_model_path,
    )

    folder = resolve_model_path(str(gguf))
    out = cache_dir() / "test-models" / f"{folder.name}-float32"
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kept = shutil.ignore_patterns(".radixrt-packed-groups*", SKELETON_FILE)  # the file's, not ours
    shutil.copytree(folder, tmp, ignore=kept)
    reader = GGUFWeightReader(gguf, AutoConfig.from_pretrained(folder), folder)
    with SafetensorsWriter(tmp / "model.safetensors", len(reader.names)) as writer:
        for name in sorted(reader.names):
            writer.add(name, reader.whole(name))
    if (out / "model.safetensors").is_file():  # the other worker's, whole
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


# a tiny Qwen3.5 (its text model): three Gated DeltaNet layers to one attention layer, 4 value
# heads over 2 key heads
QWEN3_5 = dict(
    TINY,
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=4096,
    pad_token_id=0,
)


def random_checkpoint(
    folder: Path, tokenizer_dir: Path, model_type: str, shape: dict, seed: int
) -> Path:
    """A random `model_type` checkpoint of `shape` made with transformers' own config class,
    saved in `folder` with `tokenizer_dir`'s tokenizer. Norms start at 1 (or 0): their weights
    get noise so that they count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param, weight in model.named_parameters():
            if "norm" in param:
                weight.add_(torch.randn_like(weight) * 0.2)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes((tokenizer_dir / file).read_bytes())
    return folder


def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@lru_cache(maxsize=4)
def _peft_model(folder: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def make_lora_adapter(
    folder: Path, out: Path, rank: int, targets: list[str], seed: int, **config
) -> Path:
    """A random peft LoRA adapter (`init_lora_weights=False`: B is not zero, so it changes the
    answers) of rank `rank` over `targets` of the model in `folder`, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank,
        lora_alpha=config.pop("lora_alpha", 2 * rank),
        target_modules=targets,
        init_lora_weights=False,
        **config,
    )
    get_peft_model(base, lora).save_pretrained(out)
    return out


def hf_greedy(
    folder: Path, prompts: list[list[int]], max_new_tokens: int, adapter: Path | None = None
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its own KV cache, one prompt at a
    time (no padding), never stopping early: EOS is just another token here. With `adapter`,
    under that peft LoRA adapter. Each step names its token's position (Bamba's model numbers
    a call's tokens from 0 when not told, its cache notwithstanding)."""
    model = _hf_model(str(folder)) if adapter is None else _peft_model(str(folder), str(adapter))
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    position_ids=torch.tensor([[len(ids) + len(tokens) - 1]]),
                    use_cache=True,
                )
            outs.append(tokens)
    return outs


def assert_prompt_logprobs_match(folder: Path, ids: list[int]) -> None:
    """Every position of `ids` but the first: the log-probability radixrt's scheduler gives
    the next token (`return_logprob` from position 0) equals transformers' float32, within
    1e-4: finer than greedy tokens (a soft-cap or a divisor of the logits leaves the argmax
    where it was)."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler
    from radixrt.sampling_params import SamplingParams

    scheduler = Scheduler.from_server_args(
        ServerArgs(model=str(folder), attention_backend="torch", max_total_tokens=512)
    )
    params = {"max_new_tokens": 0, "logprob_start_len": 0, "return_logprob": True}
    req = scheduler.make_request("score", ids, SamplingParams.from_dict(params))
    scheduler.add_request(req)
    while scheduler.has_work():
        scheduler.step()
    with torch.inference_mode():
        logits = _hf_model(str(folder))(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    got = torch.tensor([lp for lp, _ in req.input_token_logprobs[1:]])  # the first's is None
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def shared_prefix_prompts(tokenizer, n: int = 12) -> list[list[int]]:
    """Prompts that share prefixes at several depths, so the tree branches and splits."""
    system = (
        "You are a careful assistant. Answer briefly and precisely, in plain words, "
        "without lists, and say so when you do not know. "
    )
    topics = ["the sea", "mountains", "rivers", "deserts", "forests", "the moon"]
    prompts = []
    for i in range(n):
        topic = topics[i % len(topics)]
        style = "Write a short poem about" if i % 2 else "Tell me one fact about"
        prompts.append(
            tokenizer.encode(
                f"{system}{style} {topic}." + " Please." * (i // len(topics)),
                add_special_tokens=False,
            )
        )
    return prompts


# A drain's bound: forward steps (a stalled step, one waiting on a constraint that compiles in a
# worker process, runs nothing and is not counted) and wall-clock seconds.
DRAIN_STEPS = 400
DRAIN_SECONDS = 120.0
STALLED_SLEEP_S = 0.005


def drain(scheduler, after_step=None, max_steps: int = DRAIN_STEPS) -> list:
    """Step until nothing is left; returns every request step() reported, in order.

    after_step(scheduler) runs after each step (invariant checks). A step that runs nothing
    because every waiting request's constraint still compiles sleeps instead of counting: a
    compile worker starting on a loaded 2-core machine may take longer than hundreds of steps."""
    reported, steps, deadline = [], 0, time.monotonic() + DRAIN_SECONDS
    while scheduler.has_work():
        assert steps < max_steps and time.monotonic() < deadline, (
            f"still {len(scheduler.running)} running, {len(scheduler.waiting)} waiting "
            f"after {steps} steps"
        )
        reported += scheduler.step()
        if after_step is not None:
            after_step(scheduler)
        if scheduler.stalled:
            time.sleep(STALLED_SLEEP_S)
        else:
            steps += 1
    return reported


# The default model's vocabulary padded past its tokenizer, as some models' embeddings are: masks
# must cover the padding (and never allow it).
PADDED_VOCAB = TINY["vocab_size"] + 64
# a flat JSON record the structured tests decode (outlines-core's own bound on the age's digits)
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "maxDigits": 3},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
}


def allowed_ids(row: torch.Tensor) -> list[int]:
    """The token ids a packed bitmask row (int32 words, bit i of word w = token 32w + i) allows,
    in order."""
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1).nonzero().view(-1).tolist()


def http_json(
    url: str,
    body: dict | bytes | None = None,
    *,
    key: str | None = None,
    timeout: float = REPLY_TIMEOUT_S,
) -> tuple[int, Any]:
    """One HTTP call: POST `body` (a map as JSON, bytes as they are; GET without one), with
    `key` as its Bearer key; the status and the parsed JSON reply, an error's too."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def make_scheduler(model_dir, **overrides):
    """An in-process Scheduler on `model_dir` with the torch attention backend and a small pool
    (512 tokens) unless `overrides` (any `ServerArgs` field) say otherwise: tests that observe
    the scheduler's internals drive it with `drain` or `run_in_process`."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    settings = {"attention_backend": "torch", "max_total_tokens": 512, **overrides}
    return Scheduler.from_server_args(ServerArgs(model=str(model_dir), **settings))


def tier_engine(model_dir, **overrides):
    """An in-process `rt.Engine` on `model_dir` for the memory tiers' tests: warnings only,
    every reply waited for at most REPLY_TIMEOUT_S; `overrides` are `ServerArgs` fields."""
    import radixrt as rt

    return rt.Engine(
        model=str(model_dir), log_level="warning", timeout=REPLY_TIMEOUT_S, **overrides
    )


def assert_tiers_free(engine) -> None:
    """Nothing leaked: the invariants hold and, after a flush, both pools are entirely free."""
    engine.check_invariants()
    assert_slot_ownership(engine.memory_snapshot())
    assert engine.flush_cache()
    assert_all_free(engine.memory_snapshot())
    stats = engine.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
    assert stats["host_used_tokens"] == 0


def serve_argv(model, *flags: str) -> list[str]:
    """`python -m radixrt serve --model MODEL FLAGS...`, for tests that run the command itself
    (a restart on the same port, a refusal at start)."""
    return [sys.executable, "-m", "radixrt", "serve", "--model", str(model), *flags]


def launch_runtime(model, *, http: bool = False, **overrides):
    """`rt.Runtime` on `model` as the tests start it: ZeroMQ only unless `http` (the gateway costs
    a process and seconds of start-up where HTTP is not the point), a 2048-token pool, warnings
    only, and every reply waited for at most REPLY_TIMEOUT_S; `overrides` are `ServerArgs`
    fields (or `Runtime`'s own keywords)."""
    import radixrt as rt

    settings = {
        "max_total_tokens": 2048,
        "log_level": "warning",
        "timeout": REPLY_TIMEOUT_S,
        "disable_http": not http,
        **overrides,
    }
    return rt.Runtime(model=str(model), **settings)


def run_in_process(scheduler, batches: list[list[list[int]]], params: dict) -> list[list[int]]:
    """Drive a Scheduler directly (no runtime process), one batch of prompts after another,
    so tests can observe its internals; returns every request's output ids in order."""
    return [r.output_ids for r in requests_in_process(scheduler, batches, params)]


def requests_in_process(scheduler, batches: list[list[list[int]]], params: dict) -> list:
    """`run_in_process`'s finished requests themselves (their logprobs, timings...), in order."""
    from radixrt.sampling_params import SamplingParams

    done = []
    for b, prompts in enumerate(batches):
        reqs = [
            scheduler.make_request(f"{b}-{i}", p, SamplingParams.from_dict(params))
            for i, p in enumerate(prompts)
        ]
        for req in reqs:
            scheduler.add_request(req)
        drain(scheduler)
        done += reqs
    return done


class LaunchSpy:
    """Stands in for a @triton.jit kernel in its module: records the grid and keyword arguments
    (the tile sizes among them) of every launch, then launches the real kernel with them."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append((tuple(grid), kwargs))
            return launch(*args, **kwargs)

        return run


def run_script(harness, script: list[tuple[str, object]]) -> None:
    """Apply each (operation, argument) of a hypothesis-drawn script to a harness, checking its
    invariants after every one."""
    for op, arg in script:
        getattr(harness, op)(arg)
        harness.check()


def scripts(operations: list[tuple[str, object]], max_size: int):
    """A hypothesis strategy of operation scripts: lists of (name, argument), each argument drawn
    from its operation's strategy. Name an operation twice to draw it twice as often."""
    from hypothesis import strategies as st

    return st.lists(
        st.one_of(*(st.tuples(st.just(name), arg) for name, arg in operations)), max_size=max_size
    )


# (frame, rid the error reply carries, its code)
BAD_FRAMES = [
    (pickle.dumps({"op": "generate", "rid": "p", "text": "hi"}), None, "invalid_request"),
    *[(msgpack.packb(m), None, "invalid_request") for m in ([1, 2, 3], "just a string", {"op": 5})],
    *[
        # a rid that is not a string (or an int) is not echoed: its error carries none
        (msgpack.packb({"rid": rid, **m}), rid if isinstance(rid, str) else None, code)
        for rid, m, code in [
            ("a", {"op": "no_such_op"}, "invalid_request"),
            (["not", "a", "string"], {"op": "generate", "text": "hi"}, "invalid_request"),
            ("b", {"op": "generate", "text": 12}, "invalid_request"),
            ("c", {"op": "generate", "input_ids": "abc"}, "invalid_request"),
            ("d", {"op": "generate", "input_ids": [10**12]}, "invalid_request"),
            ("e", {"op": "generate", "input_ids": [-1, 5]}, "invalid_request"),
            ("f", {"op": "generate", "input_ids": [7] * 100_000}, "context_length_exceeded"),
            (
                "g",
                {"op": "generate", "text": "hi", "sampling_params": {"temperature": -3}},
                "invalid_request",
            ),
            (
                "h",
                {"op": "generate", "text": "hi", "sampling_params": {"max_new_tokens": 10**12}},
                "invalid_request",
            ),
            (
                "i",
                {"op": "generate", "text": "hi", "sampling_params": {"regex": "(unclosed"}},
                "invalid_constraint",
            ),
            (
                "j",
                {"op": "generate", "text": "hi", "sampling_params": "not a map"},
                "invalid_request",
            ),
            ("k", {"op": "generate", "text": "hi", "input_ids": [1]}, "invalid_request"),
            ("l", {"op": "tokenize", "text": None}, "invalid_request"),
            ("m", {"op": "generate", "text": "hi", "no_such_field": 1}, "invalid_request"),
            ("n", {"op": "generate", "text": "hi", "stream": "yes"}, "invalid_request"),
        ]
    ],
]


def assert_bad_frames_get_their_errors(url: str) -> None:
    """Garbage, wrong types and impossible requests, straight on a DEALER socket: each gets its
    error with the right code, none an internal_error, and a two-frame message is dropped."""
    rng = random.Random(0)
    noise = [
        (bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), None, "invalid_request")
        for _ in range(20)
    ]
    frames = noise + BAD_FRAMES
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    for frame, _, _ in frames:
        sock.send(frame)
    sock.send_multipart([b"two", b"frames"])  # dropped: a message is one map
    replies = []
    deadline = time.monotonic() + 30
    while len(replies) < len(frames) and time.monotonic() < deadline:
        if sock.poll(1000):
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if reply != PROBE:  # the liveness probe a client with work there gets
                replies.append(reply)
    sock.close()
    ctx.term()
    assert len(replies) == len(frames) and all("error" in r for r in replies)
    assert not [r for r in replies if r["error"]["code"] == "internal_error"]
    got = sorted((str(r["rid"]), r["error"]["code"]) for r in replies)
    assert got == sorted((str(rid), code) for _, rid, code in frames)
    assert all(r["error"]["type"] == r["error"]["code"] and r["error"]["message"] for r in replies)


def kill_a_streaming_client(url: str, input_ids: list[int], max_new_tokens: int) -> None:
    """A client process that streams one greedy request from `url`, SIGKILLed once its first
    chunk arrived: it vanishes without a word, as a crashed program does."""
    script = (
        "import radixrt as rt\n"
        f"e = rt.RuntimeEndpoint({url!r}, timeout=60)\n"
        f"for chunk in e.generate(input_ids={input_ids!r}, sampling_params="
        f"{{'max_new_tokens': {max_new_tokens}, 'temperature': 0, 'ignore_eos': True}},"
        " stream=True):\n"
        "    print('streaming', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "streaming"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)


def ref_fan_out(k: int) -> dict:
    """A JSON schema of three levels of `k` required properties, each a `$ref` to the level
    below: O(k) chars whose regex, every `$ref` written out, takes O(k^3) (6.5 MB at k = 64)."""

    def level(child: dict) -> dict:
        names = [f"p{i}" for i in range(k)]
        return {"type": "object", "properties": dict.fromkeys(names, child), "required": names}

    return {
        "$defs": {"l2": level({"type": "integer"}), "l1": level({"$ref": "#/$defs/l2"})},
        **level({"$ref": "#/$defs/l1"}),
    }


def finish_order(admin, queued: list[tuple[str, object, int]]) -> list[str]:
    """On a runtime that runs one request at a time: a long stream from `admin` runs, then each
    (name, endpoint, priority) of `queued` is sent in turn, 0.3 s apart, and waits behind it;
    the stream is aborted once all wait, and the names are returned in the order their requests
    finished (so priorities, as capped, decide it)."""
    from radixrt.client.base import RequestOptions

    finished: list[str] = []

    def run(name: str, endpoint, priority: int) -> None:
        endpoint.generate(
            input_ids=[5, 6, 9],
            sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            options=RequestOptions(priority=priority),
        )
        finished.append(name)

    long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    blocker = admin.generate(input_ids=[5, 6, 7], sampling_params=long, stream=True)
    next(blocker)
    threads = [threading.Thread(target=run, args=item) for item in queued]
    for t in threads:
        t.start()
        time.sleep(0.3)  # each request waits before the next arrives
    deadline = time.monotonic() + 30
    while admin.stats()["waiting"] < len(queued) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert admin.stats()["waiting"] == len(queued), "all must wait behind the running one"
    blocker.close()  # aborts it: the waiting ones run, one at a time
    for t in threads:
        t.join(REPLY_TIMEOUT_S)
    return finished


def seeded_id_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` seeded prompts of token ids: a 20-token prefix they all share, then 1 to 11 of their
    own (ids within the default vocabulary)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(20)]
    return [
        shared + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 12))] for _ in range(n)
    ]


QUALITY_TEXT = DATA / "quality_text.txt"  # the quality gates' fixed text
QUALITY_POSITIONS = 500  # teacher-forced positions the gates score


def teacher_forced_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits [n, V] float64 of a ModelRunner at every position of `ids`, in one prefill over
    slots 1..n (and state slot 0, from zeros, for a recurrent model)."""
    from radixrt.forward_batch import ForwardBatch

    n = len(ids)
    slots = torch.arange(1, n + 1)
    runner.req_to_token_pool.req_to_token[1, :n] = slots.to(torch.int32)
    positions = torch.arange(n)
    batch = ForwardBatch(torch.tensor(ids), positions, slots, torch.tensor([1]), [0], [n])
    if runner.model.recurrent:
        batch.state_slots = torch.tensor([0])
    return runner.logits(runner.forward(batch)).double()


@dataclass
class QualityReference:
    """float32's ModelRunner on the default model, the quality text's first ids and its
    teacher-forced logits: what quantized weights are held against."""

    runner: Any
    ids: list[int]
    logits: torch.Tensor

    @classmethod
    def of_default_model(cls) -> QualityReference:
        from radixrt.config import ServerArgs
        from radixrt.executor.model_runner import ModelRunner

        runner = ModelRunner(ServerArgs(max_total_tokens=1024, quantization="none").executor)
        ids = runner.tokenizer.encode(QUALITY_TEXT.read_text())[: QUALITY_POSITIONS + 1]
        assert len(ids) == QUALITY_POSITIONS + 1
        return cls(runner, ids, teacher_forced_logits(runner, ids)[:QUALITY_POSITIONS])


def quality_gates(reference: QualityReference, runner, name: str) -> tuple[float, float]:
    """(perplexity over float32's, top-1 agreement with float32) of a ModelRunner on the
    quality text."""
    logits = teacher_forced_logits(runner, reference.ids)[:QUALITY_POSITIONS]
    targets = torch.tensor(reference.ids[1:])
    ppl = [
        float(torch.exp(-rows.log_softmax(-1).gather(1, targets[:, None]).mean()))
        for rows in (reference.logits, logits)
    ]
    agreement = float((logits.argmax(-1) == reference.logits.argmax(-1)).double().mean())
    print(f"perplexity float32 {ppl[0]:.3f}, {name} {ppl[1]:.3f}; top-1 {agreement:.3f}")
    return ppl[1] / ppl[0], agreement


def run_weather_agent(model_class: str, http_url: str, max_tokens: int) -> None:
    """openai-agents, unchanged, with its `model_class` (OpenAIChatCompletionsModel or
    OpenAIResponsesModel) against a gateway at `http_url`: the model must call get_weather on
    the first turn (tool_choice required, reset after the call), then answer."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=getattr(agents, model_class)(model="default", openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=max_tokens
        ),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert seen and all(isinstance(city, str) for city in seen)
    assert isinstance(result.final_output, str) and result.final_output


def gateway_pid(runtime_pid: int) -> int:
    """The `radixrt http-gateway` child of the runtime process, found through /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == runtime_pid and b"http-gateway" in cmdline:
            return int(entry)
    raise AssertionError(f"no http-gateway child of {runtime_pid}")


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def mutated_header(data, original: bytes, header: int) -> bytes:
    """`original` (a GGUF file's bytes, an image's) with 1 to 4 mutations drawn by hypothesis's
    `data` in its first `header` bytes (a GGUF's header, metadata and tensor table; an image's
    headers): a byte overwritten, a u64 set to an edge value, bytes cut or inserted."""
    import struct

    from hypothesis import strategies as st

    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header - 1))
        how = data.draw(st.sampled_from(["byte", "u64", "cut", "insert"]))
        if how == "byte":
            mutated[at] = data.draw(st.integers(0, 255))
        elif how == "u64":
            value = data.draw(st.sampled_from([0, 1, 7, 2**31, 2**32 - 1, 2**63, 2**64 - 1]))
            mutated[at : at + 8] = struct.pack("<Q", value)
        elif how == "cut":
            del mutated[at : at + data.draw(st.integers(1, 64))]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    return bytes(mutated)


def write_random_gguf(path, tensors: dict, width: int) -> None:
    """A llama GGUF at `path` (gguf's own writer) holding, for each name -> (rows, type) of
    `tensors`, random normal weights [rows, width] quantized by gguf to that type (seed 0)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    for name, (rows, kind) in tensors.items():
        w = rng.standard_normal((rows, width)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
