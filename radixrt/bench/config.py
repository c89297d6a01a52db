"""`radixrt bench`'s settings: one frozen `BenchConfig` composed of groups, as `radixrt serve`'s
`ServerArgs` is (`radixrt.config.Settings` generates the flags, one a setting, in the `--help`
section of the group that declares it).

The records the bench's parts take are built from it: `server` (its `BenchServer` group: what
every radixrt system is launched with), `shape` (the workload's `WorkloadConfig`), `loads` (one
`Load` per run of a system) and `slo`. A setting that means what a `radixrt serve` flag means
is that flag's (`shared`): same name, help and choices, and the server's default unless the
bench needs its own, which its help then states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from radixrt.bench.datasets import DATASET_WORKLOADS
from radixrt.bench.load import Load
from radixrt.bench.metrics import SLO
from radixrt.bench.programs import PROGRAM_WORKLOADS
from radixrt.bench.variants import DEFAULT_SYSTEMS, PEERS, VARIANTS
from radixrt.bench.workloads import REQUEST_WORKLOADS, WorkloadConfig
from radixrt.config import (
    BatchSettings,
    CacheSettings,
    ModelSettings,
    ParallelSettings,
    Settings,
    setting,
    shared,
)

# timings of an in-process scheduler or model runner: no server started
IN_PROCESS_WORKLOADS = (
    "decode-step",
    "quant-step",
    "family-step-times",
    "hybrid-prefix",
    "kv-cache-dtype",
    "spec-ab",
    "logprob-drift",
)
# a served radixrt (or a peer) measured by a client in this process
SERVED_WORKLOADS = (
    "router-overhead",
    "flood-latency",
    "weight-update-time",
    "ray-routing",
    "serve-defaults",
)
# of `--workload gpu-check` (radixrt.bench.gpu_check), in the order they run
GPU_CHECK_SECTIONS = (
    "check_correctness",
    "bench_decode",
    "bench_extend",
    "check_cuda_graphs",
    "check_speculative",
    "check_hicache",
    "check_tensor_parallel",
    "sweep_configs",
    "check_engine",
    "check_families",
    "check_fused_moe",
    "check_deterministic_rows",
    "check_kv_quant",
    "check_packed_gemm",
)
# the workloads that run radixrt variants only, one after another (`--systems`)
VARIANT_WORKLOADS = ("flood-latency", "weight-update-time")

WORKLOADS = (
    *REQUEST_WORKLOADS,
    *DATASET_WORKLOADS,
    *PROGRAM_WORKLOADS,
    "agent-tools",
    "grammar",
    "lora",
    "kernels",
    *IN_PROCESS_WORKLOADS,
    *SERVED_WORKLOADS,
    "gpu-check",
    "all",
)
BACKENDS = ("engine", "server", "http", "openai")
DEFAULT_NUM_REQUESTS = 64  # of request and program workloads; the HTTP suites keep their own
DEFAULT_MAX_NEW_TOKENS = 64  # of every workload but logprob-drift


@dataclass(frozen=True, kw_only=True)
class BenchSuite(Settings):
    section: ClassVar[str] = "what runs"
    # fmt: off
    workload: str = setting("shared-prefix", "request workloads: shared-prefix, multi-prefix, multi-turn, long-prompt, random, json, agent-loop, few-shot, sharegpt (--dataset-path); DSL programs: agent, few-shot-select, tree-of-thought; agent-tools (with --backend http): tool-calling agents per tool_choice against an unconstrained run; grammar: compile and mask times of each grammar backend (tokenizer only); lora: decode step time at a batch of --num-requests (32) under 0/1/4/8 adapters against the base, and adapter load time; kernels: the CPU's int4 GEMM GOP/s on the 1.1B shape at 1 to 512 rows per --cpu-isa path and against the kernel before, and the host's read bandwidth (no model); decode-step: a decode step at --batches (32) over private --contexts (512,2048), decode attention reading K/V in place against gathering them; quant-step: a decode step with float32, int8 and int4 weights at --batches (1,32); family-step-times: a decode step of each model family's random checkpoint of one small shape against llama's at --batches (1,32), with a bar plot; hybrid-prefix: prefix hit rate and time of an agent loop and a shared prompt on Qwen3.5- and Bamba-shaped random checkpoints of --hybrid-shape (their state snapshots), against a Llama of their shape and themselves with the cache off, with a bar plot; kv-cache-dtype: each --kv-cache-dtype's bytes per token (pool, host and disk tiers) and the model's forward at --batches (1,4) over --contexts (2048,8000); spec-ab: one stream's decode speed with speculation on and off, interleaved over --rounds (3) of --spec-workload's prompts; logprob-drift: how far greedy logprobs move when a prompt is batched, cached, chunked or served int8, against it served alone; router-overhead: TTFT through `radixrt router` against the worker reached directly, in turns over --rounds (40); flood-latency: a request's latency alone and during a keyless flood of one-byte frames, per --systems variant (radixrt; radixrt-dp2 a fleet); weight-update-time: update_weights_from_disk and _from_tensor through rt.Engine, per --systems variant (radixrt); ray-routing: prefix-cache hit rate and throughput of two replicas behind Ray Serve LLM, RadixAffinityRouter against Ray's default (needs ray); serve-defaults: radixrt serve against llama-server on the GGUF --model, each with its default flags: time to healthy, one stream, --concurrency (32) clients with nothing shared and sharing a prefix, peak RSS; gpu-check: the Triton kernels and the engine on a CUDA device, its --gpu-sections (every one); all: every request and program workload in turn, plus a hit-rate plot", choices=WORKLOADS)
    systems: str | None = setting(None, f"comma list of {', '.join([*VARIANTS, *PEERS])} (default: the workload's own comparison)")
    backend: str = setting("engine", "engine: rt.Engine (ipc socket); server: rt.Runtime over TCP; http: multi-turn chat through the OpenAI API against the same conversations over ZeroMQ; openai: a request workload against the OpenAI-compatible server at --base-url (nothing is started)", choices=BACKENDS)
    base_url: str | None = setting(None, "with --backend openai: the server, e.g. http://127.0.0.1:8000 (or its /v1); the key is $OPENAI_API_KEY; --model names the tokenizer the workload is built with")
    served_model_name: str | None = setting(None, "with --backend openai: the model name requests send (default: the server's first in /v1/models)")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BenchServer(Settings):
    """What every radixrt system of a run is launched with, before its variant's settings: a
    `radixrt serve` setting is serve's own (`shared`), at the bench's default where it needs
    one."""

    section: ClassVar[str] = (
        "the model and radixrt's settings (as `radixrt serve`'s flags; a variant may override them)"
    )
    # fmt: off
    model: str = shared(ModelSettings, "model")
    model_shape: str | None = setting(None, "replaces --model: a random-weight checkpoint of this model's shape, made once under the cache dir with its Q4_0, Q4_K_M and Q8_0 GGUF files (radixrt runs the float weights, quantizing them itself; to serve one of the GGUF files under radixrt-gguf, pass it as --model; the llama.cpp peers run the GGUF --llama-gguf-type names)", choices=("tinyllama-1.1b", "llama-3.2-3b"))
    hybrid_shape: str = setting("small", "hybrid-prefix: the random checkpoints' shape: small (hidden 512, 8 layers; with Bamba) or qwen3.5-0.8b (Qwen3.5-0.8B's layers at the default model's vocabulary, about 0.5B parameters; Llama and Qwen3.5 only)", choices=("small", "qwen3.5-0.8b"))
    llama_gguf_type: str = setting("Q4_0", "with --model-shape: the GGUF file the llama.cpp peers run", choices=("Q4_0", "Q4_K_M", "Q8_0"))
    dtype: str = shared(ModelSettings, "dtype")
    max_total_tokens: int | None = shared(CacheSettings, "max_total_tokens", None, "; unset, every system runs at its own defaults, as a new user meets it (radixrt sizes its pool, llama-server its context and slots); set, every system has the same KV memory (a fleet shares it among its workers, llama-server has a slot per request in flight)")
    tp_size: int = shared(ParallelSettings, "tp_size")
    chunked_prefill_size: int = shared(BatchSettings, "chunked_prefill_size")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BenchLoad(Settings):
    section: ClassVar[str] = "load"
    # fmt: off
    request_rate: float | None = setting(None, "open loop: Poisson arrivals per second (default: all at once)")
    concurrency: int | None = setting(None, "closed loop: this many clients, each sending its next session when one ends (transformers: its batch, 64 when unset)")
    sweep_rate: str | None = setting(None, "comma list of request rates: run each system at each, plot throughput and TTFT against rate, and report where median TTFT crosses the SLO")
    max_concurrency: int | None = setting(None, "at most this many requests in flight, arrivals waiting their turn (vLLM's flag; with no --request-rate: this many clients at once)")
    max_duration: float | None = setting(None, "seconds after which no new session starts")
    slo_ttft: float = setting(1.0, "goodput SLO: time to first token (s)")
    slo_tpot: float = setting(0.05, "goodput SLO: time per output token (s)")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BenchShape(Settings):
    section: ClassVar[str] = "workload shape"
    # fmt: off
    num_requests: int | None = setting(None, f"requests (conversations, programs) per run (default: {DEFAULT_NUM_REQUESTS}; 10 conversations with --backend http, 8 agents with agent-tools)")
    max_new_tokens: int | None = setting(None, f"mean output length (default: {DEFAULT_MAX_NEW_TOKENS}; logprob-drift: 16, each prompt's greedy tokens)")
    fixed_output_len: bool = setting(False, "every output exactly --max-new-tokens long")
    prefix_tokens: int = setting(500, "shared-prefix: shared system prompt length")
    question_tokens: int = setting(30, "a question's length")
    turns: int = setting(6, "multi-turn: turns per conversation; agent-tools: tool-call turns per agent")
    num_prefixes: int = setting(8, "multi-prefix: distinct system prompts")
    long_prompts: int = setting(4, "long-prompt: long prompts among the short ones")
    long_tokens: int = setting(4000, "long-prompt: a long prompt's length")
    random_input_len: int | None = setting(None, "random: every prompt this many tokens (default: --question-tokens to 4x)")
    random_output_len: int | None = setting(None, "random: every output this many tokens (default: as --max-new-tokens)")
    dataset_path: str | None = setting(None, "sharegpt: a ShareGPT-format JSON or JSON Lines file (each conversation's first human turn is a prompt, its reply's length the output's)")
    seed: int = setting(0, "of the workload's text and of the open loop's arrivals")
    temperature: float = setting(0.0, "of every request (0: greedy; sampled text has less to copy for speculation)")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BenchMeasure(Settings):
    """The knobs of the suites that time a step, a request or an update in this process (the
    step, A/B and served-latency suites); unset, each suite's own default, which its help names."""

    section: ClassVar[str] = "in-process measures (the step, A/B and served-latency suites)"
    # fmt: off
    batches: str | None = setting(None, "comma list of batch sizes, the requests decoding at once in a timed step (default: decode-step 32; quant-step, family-step-times 1,32; kv-cache-dtype 1,4)")
    contexts: str | None = setting(None, "comma list of context lengths in tokens, each request's own, nothing shared (default: decode-step 512,2048; kv-cache-dtype 2048,8000; family-step-times 64, its first only)")
    steps: int | None = setting(None, "timed steps per measure (default: decode-step 5, quant-step 3, family-step-times 16, kv-cache-dtype 5)")
    repeats: int | None = setting(None, "times each measure is taken, its best kept: runs of --steps, alternated between the cases where a suite compares some (default: 2; family-step-times 3; weight-update-time 3, their median kept)")
    rounds: int | None = setting(None, "rounds of an interleaved comparison, each side once a round (default: spec-ab 3, router-overhead 40, flood-latency 5; ray-routing 6, a question to every prefix a round)")
    spec_workload: str = setting("agent-loop", "spec-ab: the request workload whose first turns both schedulers decode", choices=tuple(REQUEST_WORKLOADS))
    gpu_sections: str | None = setting(None, f"gpu-check: comma list of its sections (default: every one): {', '.join(GPU_CHECK_SECTIONS)}")
    # fmt: on

    def check(self) -> None:
        self.batch_sizes, self.context_lens  # noqa: B018 - a malformed list fails here
        for name in ("steps", "repeats", "rounds"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, not {value}")
        unknown = set(_comma_list(self.gpu_sections)) - set(GPU_CHECK_SECTIONS)
        if unknown:
            raise ValueError(
                f"unknown --gpu-sections {sorted(unknown)}: gpu-check has {', '.join(GPU_CHECK_SECTIONS)}"
            )

    @property
    def batch_sizes(self) -> list[int] | None:
        """`--batches`, or None when unset."""
        return _sizes("--batches", self.batches)

    @property
    def context_lens(self) -> list[int] | None:
        """`--contexts`, or None when unset."""
        return _sizes("--contexts", self.contexts)


def _comma_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _sizes(flag: str, text: str | None) -> list[int] | None:
    """A comma list of positive whole numbers, or None when `text` is unset; a ValueError
    naming `flag` otherwise."""
    if text is None:
        return None
    parts = _comma_list(text)
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{flag} takes a comma list of positive whole numbers, not {text!r}")
    return [int(p) for p in parts]


@dataclass(frozen=True, kw_only=True)
class BenchOutput(Settings):
    section: ClassVar[str] = "results"
    # fmt: off
    output_dir: str = setting("bench_results", "JSON results and PNG plots go here")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BenchConfig(BenchSuite, BenchServer, BenchLoad, BenchShape, BenchMeasure, BenchOutput):
    """Every flag of `radixrt bench`. Built (so checked) once from the command line; the suite
    its `suite_key` names runs it (`radixrt.bench.suites`)."""

    def check(self) -> None:
        if self.workload == "agent-tools" and self.backend != "http":
            raise ValueError("--workload agent-tools runs over HTTP: add --backend http")
        if (self.backend == "openai") != (self.base_url is not None):
            raise ValueError("--backend openai and --base-url go together")
        if self.backend == "openai" and self.workload not in (
            *REQUEST_WORKLOADS,
            *DATASET_WORKLOADS,
        ):
            raise ValueError(f"--backend openai runs a request workload, not {self.workload}")
        if (self.workload == "sharegpt") != (self.dataset_path is not None):
            raise ValueError("--workload sharegpt and --dataset-path go together")
        unknown = {s for s in (self.systems or "").split(",") if s} - {*VARIANTS, *PEERS}
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}")
        self.rates  # noqa: B018 - a malformed --sweep-rate fails here, not after a run
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, not {self.max_new_tokens}")
        if self.workload in VARIANT_WORKLOADS and set(self.systems_for(self.workload)) - set(
            VARIANTS
        ):
            raise ValueError(f"--workload {self.workload} runs radixrt variants only, not peers")

    @property
    def suite_key(self) -> str:
        """The registry key of the suite that runs this config: the workload, except that
        `--backend http` runs the HTTP chat suite for any workload but agent-tools, and
        `--backend openai` the suite that measures the server at `--base-url`."""
        if self.backend == "openai":
            return "openai"
        if self.backend == "http" and self.workload != "agent-tools":
            return "http"
        return self.workload

    def systems_for(self, workload: str) -> list[str]:
        """`--systems`, else the workload's own comparison."""
        return (self.systems or DEFAULT_SYSTEMS[workload]).split(",")

    @property
    def new_tokens(self) -> int:
        """`--max-new-tokens`, else the default every workload but logprob-drift takes."""
        return self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    @property
    def server(self) -> BenchServer:
        return BenchServer.of(self)

    @property
    def shape(self) -> WorkloadConfig:
        return WorkloadConfig(
            num_requests=self.num_requests or DEFAULT_NUM_REQUESTS,
            max_new_tokens=self.new_tokens,
            fixed_output=self.fixed_output_len,
            prefix_tokens=self.prefix_tokens,
            question_tokens=self.question_tokens,
            turns=self.turns,
            long_prompts=self.long_prompts,
            long_tokens=self.long_tokens,
            seed=self.seed,
            temperature=self.temperature,
            num_prefixes=self.num_prefixes,
            random_input_len=self.random_input_len,
            random_output_len=self.random_output_len,
            dataset_path=self.dataset_path,
        )

    @property
    def rates(self) -> list[float] | None:
        """`--sweep-rate`'s rates, or None when the run is no sweep."""
        return [float(r) for r in self.sweep_rate.split(",")] if self.sweep_rate else None

    @property
    def loads(self) -> list[Load]:
        """One load per run of a system: each swept rate, else the one load the flags set."""
        if self.rates:
            return [
                Load(rate, None, self.max_duration, self.seed, self.max_concurrency)
                for rate in self.rates
            ]
        return [
            Load(
                self.request_rate,
                self.concurrency,
                self.max_duration,
                self.seed,
                self.max_concurrency,
            )
        ]

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft, self.slo_tpot)
