"""Settings, each declared once: one line in the feature group that owns it.

A group (`CacheSettings`, `ParallelSettings`, ...) is a frozen dataclass of one feature's
settings, each `name: type = setting(default, help)`, with the rules that bind them (`check`)
and its `--help` section. A command's settings compose groups by inheriting them: `ServerArgs`
(`radixrt serve`, `rt.Engine`, `rt.Runtime`) and `RouterArgs` (`radixrt router`) here,
`BenchConfig` (`radixrt bench`) in radixrt/bench/config.py. A composition is flat (one flag,
one keyword, one attribute a setting: `--page-size`, `rt.Engine(page_size=4)`,
`args.page_size`), frozen (launchers make a new one with `dataclasses.replace`), and `Settings`
generates from its groups its command line, its keywords' checks and docs/flags.md
(`radixrt.flags_doc`).

Components receive the groups they need, composed the same way and taken from `ServerArgs` by
`of`: `ExecutorArgs` (the model runner and its ranks), `SchedulerArgs` (the scheduler),
`GatewaySettings` (the HTTP gateway); one group alone is e.g. `RouterSettings.of(args)`.

A new setting is one line in the group that owns it (a new group is a class here, and a base of
the commands that take it); then `make flags-doc`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")
S = TypeVar("S", bound="Settings")
K = TypeVar("K", bound="KeySettings")

SECRETS = {
    "api_key": "RADIXRT_API_KEY",
    "admin_api_key": "RADIXRT_ADMIN_API_KEY",
    "curve_secret_key": "RADIXRT_CURVE_SECRET_KEY",
}  # field -> env var

MIN_FRAME_BYTES = 4096  # a smaller frame limit would refuse ordinary requests
REASONING_PARSER_NAMES = ("deepseek-r1", "qwen3")  # structured/reasoning.py has each one
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ROUTER_POLICIES = ("cache-aware", "round-robin", "shortest-queue")
# a remote image's fetch (radixrt/multimodal/images.py): vLLM's default timeout
# (VLLM_IMAGE_FETCH_TIMEOUT), and the redirects followed, each one's host checked again
MEDIA_FETCH_TIMEOUT_S = 5.0
MAX_MEDIA_REDIRECTS = 3
IMAGES_PER_PROMPT = 32  # --limit-mm-per-prompt's "image" when it names none
# An image's smallest side: a ViT patch (14 pixels: CLIP's ViT-L/14 under LLaVA, SigLIP under
# Gemma 3, Qwen2.5-VL's); smaller carries less than one patch, and a side of 1 or 3 is what
# transformers' channel-axis guess takes for channels (vLLM's crash on a 1x1 image).
MIN_IMAGE_SIDE = 14


def is_loopback_host(host: str) -> bool:
    """An ipc:// path or a loopback address: reachable from this machine only."""
    return host.startswith("ipc://") or host in ("127.0.0.1", "localhost", "::1")


WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")  # a ZeroMQ bind to these listens everywhere


def tcp_host(endpoint: str | None) -> str | None:
    """The host of a tcp:// ZeroMQ address (None for another transport, or none)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0]


def endpoint_of(host: str, port: int) -> str:
    """ZeroMQ address to bind: `host` may itself be an ipc:// path."""
    return host if host.startswith("ipc://") else f"tcp://{host}:{port}"


def setting(
    default: T, help: str, *, choices: Sequence[Any] | None = None, nargs: str | None = None
) -> T:
    """One setting of a group: its default and its `--help` text. `choices`: its closed set of
    values (checked when the settings are built); `nargs="+"`: a tuple setting given as
    `--flag A B` rather than `--flag A --flag B`."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if nargs is not None:
        metadata["nargs"] = nargs
    return field(default=default, metadata=metadata)


def shared(
    owner: type[Settings], name: str, default: Any = dataclasses.MISSING, why: str = ""
) -> Any:
    """Another command's field for `owner`'s setting `name` (the bench's `--model` is serve's):
    the same help and choices, and the same default unless that command needs its own, which
    `why` (appended to the help) then explains."""
    f = _fields(owner)[name]
    default = f.default if default is dataclasses.MISSING else default
    metadata = {**f.metadata, "help": f.metadata["help"] + why, "shares": owner}
    return field(default=default, metadata=metadata)


def _fields(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _at_least_one(**values: int | None) -> None:
    """Each value unset (None) or >= 1; else a ValueError naming it."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1")


# ---- groups and their compositions: flags, keywords and checks generated from the fields ------
class Settings:
    """A group of settings, or a composition of groups. A group sets `section` (its `--help`
    section title; several groups may share one) and declares its settings with `setting`; a
    composition inherits its groups and declares none. Building either checks every setting's
    choices, then each group's `check`, then the composition's own `check` (rules across
    groups)."""

    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}  # a setting's other flag names

    def __post_init__(self) -> None:
        for f in _fields(self).values():
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, not {value!r}")
        for cls in dict.fromkeys([*self.groups(), type(self)]):
            if "check" in vars(cls):
                vars(cls)["check"](self)

    def check(self) -> None:
        """This class's own rules: a group's, or a composition's across its groups."""

    @classmethod
    def groups(cls) -> list[type[Settings]]:
        """The groups these settings compose, in `--help`'s order (a group is its own one)."""
        return [c for c in cls.__mro__ if issubclass(c, Settings) and "section" in vars(c)]

    @classmethod
    def of(cls: type[S], settings: Settings) -> S:
        """These settings taken from a composition that has them all (`ExecutorArgs.of(args)`)."""
        return cls(**{name: getattr(settings, name) for name in _fields(cls)})

    @classmethod
    def sections(cls) -> dict[str, list[dataclasses.Field[Any]]]:
        """`--help`'s sections: each title and its settings, in order. A TypeError unless every
        setting is declared by exactly one of the groups."""
        sections: dict[str, list[dataclasses.Field[Any]]] = {}
        declared: list[str] = []
        for group in cls.groups():
            own = list(_fields(group).values())
            sections.setdefault(vars(group)["section"], []).extend(own)
            declared += [f.name for f in own]
        if sorted(declared) != sorted(_fields(cls)):
            raise TypeError(
                f"{cls.__name__}: each setting is declared once, in one group "
                f"(declared: {sorted(declared)}; fields: {sorted(_fields(cls))})"
            )
        return sections

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per setting, in one argument group per section (`--help` shows them)."""
        for title, members in cls.sections().items():
            section = parser.add_argument_group(title)
            for f in members:
                _add_flag(section, f, cls.aliases.get(f.name, ()))

    @classmethod
    def from_cli_args(cls: type[S], args: argparse.Namespace) -> S:
        values = {}
        for f in _fields(cls).values():
            value = getattr(args, f.name)
            values[f.name] = tuple(value or ()) if _repeated(f) else value
        return cls(**values)

    @classmethod
    def from_kwargs(cls: type[S], **kwargs: Any) -> S:
        unknown = set(kwargs) - set(_fields(cls))
        if unknown:
            raise TypeError(f"unknown server arguments: {sorted(unknown)}")
        return cls(**kwargs)

    def to_cli_args(self) -> list[str]:
        """The flags that recreate these settings on a command line (secrets excepted: they
        travel by environment)."""
        argv = []
        for f in _fields(self).values():
            value = getattr(self, f.name)
            if value is None or f.name in SECRETS:
                continue
            flag = _flag(f)
            if isinstance(value, bool):
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif _repeated(f):
                argv += [f"{flag}={v}" for v in value]
            else:
                argv.append(f"{flag}={value}")  # one argument, even for a value like "-1"
        return argv

    def with_secrets_from_env(self: S) -> S:
        """These settings with unset secrets taken from their environment variables."""
        return dataclasses.replace(
            self,  # type: ignore[type-var]
            **{
                name: getattr(self, name) or os.environ.get(var) or None
                for name, var in SECRETS.items()
                if hasattr(self, name)
            },
        )


def _flag(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def _repeated(f: dataclasses.Field[Any]) -> bool:
    """A setting given once per value (`--worker A --worker B`), held as a tuple."""
    return str(f.type).startswith("tuple")


def _add_flag(parser: Any, f: dataclasses.Field[Any], aliases: Sequence[str]) -> None:
    names = [_flag(f), *aliases]
    helptext = f.metadata["help"]
    if f.type in ("bool", bool):
        parser.add_argument(
            *names, action=argparse.BooleanOptionalAction, default=f.default, help=helptext
        )
    elif _repeated(f) and f.metadata.get("nargs"):
        parser.add_argument(
            *names, action="extend", nargs=f.metadata["nargs"], default=None, help=helptext
        )
    elif _repeated(f):
        parser.add_argument(*names, action="append", default=None, help=f"{helptext} (repeat)")
    else:
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
            str(f.type), str
        )
        parser.add_argument(
            *names,
            type=kind,
            default=f.default,
            choices=f.metadata.get("choices"),
            help=helptext if "default:" in helptext else f"{helptext} (default: {f.default})",
        )


def physical_cores() -> int:
    """The cores this process may run on, each counted once however many hardware threads it
    has: /proc/cpuinfo's (physical id, core id) pairs over the processors of the affinity mask.
    A second hardware thread of a core shares its vector units, so a kernel's threads beyond
    the cores add barrier waits, not arithmetic. The mask's size where the ids are missing."""
    allowed = os.sched_getaffinity(0)
    cores, processor, package = set(), -1, ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "processor":
                    processor = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and processor in allowed:
                    cores.add((package, value))
    except (OSError, ValueError):
        cores = set()
    return len(cores) or len(allowed)


# ---- the groups ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelSettings(Settings):
    section: ClassVar[str] = "model and weights"
    # fmt: off
    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), a Hugging Face model folder, a .gguf file, or a Hugging Face Hub id already in the local Hub cache (needs huggingface_hub; nothing is downloaded)")
    served_model_name: str | None = setting(None, "the model's name in the OpenAI API (/v1/models, each response's `model`) and in model_info (default: --model as given, a path by its last part: no tenant sees a server path)")
    tokenizer_path: str | None = setting(None, "the tokenizer's folder or Hugging Face Hub id, when it is not the model's (default: --model)")
    chat_template: str | None = setting(None, "the chat template to use instead of the tokenizer's: a file holding a Jinja template, or the template itself")
    attention_backend: str = setting("auto", "auto (triton on CUDA, torch on CPU), torch or triton", choices=("auto", "torch", "triton"))
    dtype: str = setting("auto", "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = setting("auto", "auto, cpu or cuda")
    quantization: str | None = setting("auto", "the linears' weights: auto (a model given as a GGUF file, default or a .gguf path, serves its quantized tensors as stored, packed: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K, IQ4_NL/IQ4_XS and, on a CPU, Q3_K (4 bits a weight) and Q2_K (3.5) at their own widths (on a GPU Q3_K and Q2_K in 8-bit groups), F16/BF16 on a CPU at 16 bits a weight (converted to float32 as multiplied), the rest (other IQ types; F16/BF16 on a GPU, in the run's dtype) dequantized to float; on one rank, on the CPU's kernels or a CUDA GPU, without --enable-deterministic-inference; every other model as its checkpoint says: float, or its own quantization_config; model_info and the start-up log say what was chosen and why); none (float: a GGUF dequantized, as transformers reads it; token-exact); int8 (per channel) or int4 (groups of 32; a GGUF's quantized tensors as stored), quantized at load, quality-gated, not token-exact; gguf (as auto for a GGUF, refused for any other model). Quantized linears run on CPUs with AVX2 (the C kernels) or CUDA GPUs (a Triton kernel)", choices=("auto", "none", "int8", "int4", "gguf"))
    cpu_isa: str = setting("auto", "the instruction-set path of the CPU's quantized linears (--quantization): auto (the best this CPU runs; torch, with a warning, on a CPU without AVX2); amx (AMX-INT8 tiles for the many-row multiplies of prefill, avx512-vnni's kernels for the rest: CPUs with AMX whose OS grants the tile state, Sapphire Rapids and later); avx512-vnni (the C kernels with VNNI dot products: AVX-512 F, VL, BW and VNNI); avx-vnni (the same in their VEX form: AVX-VNNI, without AVX-512); avx2 (the C kernels); torch (the packed weights dequantized on every call: slow, any CPU). Every path gives the same bits. Naming a path this CPU cannot run is refused at start; model_info and the start-up log name the path taken", choices=("auto", "amx", "avx512-vnni", "avx-vnni", "avx2", "torch"))
    cpu_threads: int = setting(0, "threads of the CPU's kernels and torch ops, over all of this machine's tensor-parallel ranks (each takes its share) or data-parallel workers; 0: the physical cores this process may run on (or OMP_NUM_THREADS, where set). More threads than cores only add barrier waits")
    disable_cuda_graph: bool = setting(False, "on CUDA, launch every decode step's kernels instead of replaying graphs")
    generation_config: str = setting("auto", "auto: the model's generation_config.json gives the sampling defaults a request does not set (docs/protocol.md); ignore: radixrt's own", choices=("auto", "ignore"))
    context_length: int | None = setting(None, "max prompt+output tokens per request (default: the model's)")
    is_embedding: bool = setting(False, "serve embeddings, not generation: POST /v1/embeddings (and generate requests of max_new_tokens 0, whose reply carries `embedding`) pool the prompt's final hidden states as the model's sentence-transformers files say (last token or mean; normalized where they list Normalize; last token, normalized, without them)")
    enable_deterministic_inference: bool = setting(False, "bitwise-reproducible serving (SGLang's name): a request's tokens and logprobs do not depend on its batch, how much of its prompt came from the cache, the prefill chunk size, speculation or tp 1 vs 2; every linear and attention row is summed in one fixed order (slower; docs/serving.md). CPU, float32 weights and KV or --quantization int8/int4")
    weights_update_timeout: float = setting(300.0, "seconds init_weights_update_group waits for a trainer's group to form, and update_weights_from_distributed for its broadcasts; both run beside the serving loop (generation goes on) and are answered 'timeout' past this")
    weights_update_allowed_hosts: tuple[str, ...] = setting(("127.0.0.1", "localhost", "::1"), "the master_address values init_weights_update_group may join (as given, not resolved; '*': any); another gets 'invalid_request'", nargs="+")
    # fmt: on

    def check(self) -> None:
        processors = os.cpu_count() or 1
        if not 0 <= self.cpu_threads <= processors:
            raise ValueError(
                f"cpu_threads must be in [0, {processors}] (0: the physical cores; this machine"
                f" has {processors} processors, and more threads would only wait on each other)"
            )
        if self.weights_update_timeout <= 0:
            raise ValueError("weights_update_timeout must be > 0")


@dataclass(frozen=True, kw_only=True)
class ParallelSettings(Settings):
    section: ClassVar[str] = "tensor and data parallelism"
    # fmt: off
    tp_size: int = setting(1, "tensor parallelism: shard the model's heads, MLP and vocabulary over this many rank processes (one GPU each on CUDA, cores/N threads each on the CPU), gloo on the CPU, NCCL on CUDA")
    ep_size: int = setting(1, "expert parallelism over the --tp-size ranks (1 or --tp-size): each rank holds a share of a mixture-of-experts model's experts whole, instead of a slice of every expert")
    nnodes: int = setting(1, "machines the --tp-size ranks are spread over")
    node_rank: int = setting(0, "this machine's index among --nnodes: 0 runs the scheduler and the socket, the others only host ranks")
    dist_init_addr: str | None = setting(None, "HOST:PORT where the ranks meet (torch.distributed TCP rendezvous; needed with --nnodes > 1; default: a free loopback port)")
    dp_size: int = setting(1, "data parallelism: this many workers (a share of the cores each on the CPU, their own GPUs on CUDA) behind a router on --host and the ZeroMQ port (--zmq-port), the HTTP gateway in front of it on --port")
    # fmt: on

    def check(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("tp_size and nnodes must be >= 1, node_rank in [0, nnodes)")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size must be 1 or tp_size ({self.tp_size}): experts are spread over the "
                "tensor-parallel ranks"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} does not split over {self.nnodes} nodes")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0)")
        if self.dp_size < 1 or (self.dp_size > 1 and self.nnodes > 1):
            raise ValueError("dp_size must be >= 1, and 1 with nnodes > 1 (use `radixrt router`)")


@dataclass(frozen=True, kw_only=True)
class RouterSettings(Settings):
    """How the router picks a worker. The cache-aware rules are SGLang's, with defaults sized
    for small CPU fleets:

    - `router_cache_threshold` (0.5): route by match only when the match covers at least this
      share of the prompt; below it the prefix is too short to be worth a queue, so load
      decides. Half keeps a conversation's next turn (its history is most of its prompt) and a
      system prompt shared by questions on their worker, and lets short unrelated prompts
      spread.
    - `router_balance_abs_threshold` (4) and `router_balance_rel_threshold` (1.25): when the
      busiest worker has both more than 4 sequences more and more than 1.25x as many as the
      idlest, the idlest gets the request whatever the match. Both must hold: a gap of a few
      sequences is noise at any load, and 2 against 3 is no imbalance. They are low because a
      CPU worker's decode step grows with its batch (it is compute-bound), so a worker with
      twice the sequences takes about twice as long a token; on `make bench-dp`'s 16 clients
      over two workers, 16 and 1.5 (closer to SGLang's GPU defaults) kept the hit rate but cost
      11% of the throughput of round-robin, 4 and 1.25 gained 26%. On GPUs, whose step time
      barely grows with the batch, raise them.
    """

    section: ClassVar[str] = (
        "routing over data-parallel workers (`serve --dp-size`, `radixrt router`)"
    )
    # fmt: off
    router_policy: str = setting("cache-aware", "cache-aware (the worker whose cache holds the longest prefix, unless load is out of balance), round-robin or shortest-queue", choices=ROUTER_POLICIES)
    router_cache_threshold: float = setting(0.5, "cache-aware: route by match only when it covers at least this share of the prompt")
    router_balance_abs_threshold: int = setting(4, "cache-aware: load is out of balance when the busiest worker has this many more sequences than the idlest...")
    router_balance_rel_threshold: float = setting(1.25, "...and more than this many times as many; then the idlest gets it")
    # fmt: on

    def check(self) -> None:
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError("router_cache_threshold must be in [0, 1]")
        if self.router_balance_abs_threshold < 0 or self.router_balance_rel_threshold < 1:
            raise ValueError(
                "router_balance_abs_threshold must be >= 0, router_balance_rel_threshold >= 1"
            )


@dataclass(frozen=True, kw_only=True)
class WorkerSettings(Settings):
    """The workers `radixrt router` routes over."""

    section: ClassVar[str] = (
        "the router's workers (with --api-key-file, each client's key is forwarded, so the workers need the same file)"
    )
    # fmt: off
    worker: tuple[str, ...] = setting((), "a worker's address, e.g. tcp://10.0.0.2:30001 (its ZeroMQ port); at least one")
    worker_api_key: str | None = setting(None, "what the router sends the workers (default: --admin-api-key, else --api-key, else the key file's first key)")
    worker_curve_server_key: str | None = setting(None, "the workers' CURVE public key")
    tokenizer: str | None = setting(None, "the workers' tokenizer.json, when their model folder is not on this machine")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class BatchSettings(Settings):
    section: ClassVar[str] = "scheduling and batching"
    # fmt: off
    schedule_policy: str = setting("lpm", "lpm (longest prefix match), fcfs or dfs-weight", choices=("lpm", "fcfs", "dfs-weight"))
    schedule_mode: str = setting("continuous", "continuous (requests join and leave at every step) or static (a new batch is admitted only once the previous one has fully finished: the baseline continuous batching is measured against)", choices=("continuous", "static"))
    chunked_prefill_size: int = setting(2048, "max prompt tokens per step (of one request and of all together); longer prompts are prefilled in chunks, so decodes are never stalled behind a long prefill (<=0 disables chunking)")
    max_prefill_tokens: int = setting(8192, "max new prompt tokens admitted per step over all requests")
    max_running_requests: int = setting(256, "max requests decoding at once")
    max_queued_requests: int = setting(4096, "waiting requests past which new ones get an 'overloaded' error")
    max_prompt_logprob_entries: int = setting(1 << 22, "prompt logprob values one request may ask for: n x (1 + top_logprobs_num) x scored prompt tokens; past it, 'invalid_request' before it is queued")
    random_seed: int = setting(0, "seed of the sampler for requests that set none")
    log_interval: int = setting(40, "decode steps between two throughput log lines")
    # fmt: on

    def check(self) -> None:
        _at_least_one(
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            max_queued_requests=self.max_queued_requests,
            max_prompt_logprob_entries=self.max_prompt_logprob_entries,
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`: vLLM's `KVEventsConfig` JSON, the same keys and defaults except
    `endpoint`, which binds the loopback interface unless it says otherwise. An endpoint whose
    host is a wildcard (`*`, `0.0.0.0`, `::`), a loopback address, or an ipc:// or inproc://
    address is bound; any other host is connected to (an indexer that binds, as llm-d's does).
    radixrt's own keys: `publish_tenant_token_ids` (a page under a tenant or a `cache_salt` is
    published with its block hashes but no token ids unless true) and `allow_non_loopback` (a
    wildcard bind needs it, or the server's keys: the event sockets check no key)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when events are enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    publish_tenant_token_ids: bool = False
    allow_non_loopback: bool = False

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse and check; a ValueError names the bad or unknown key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = _fields(cls)
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"kv_events_config: unknown key {key!r}")
            _check_type(key, value, str(known[key].type))
        return cls(**raw)

    def __post_init__(self) -> None:
        if self.publisher not in (None, "null", "zmq"):
            raise ValueError(
                f"kv_events_config: publisher must be 'zmq' or 'null', not {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be >= 1")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config: {name} must be a tcp://, ipc:// or inproc:// address"
                )

    def exposed_endpoints(self) -> list[str]:
        """The endpoints this config binds beyond loopback: `endpoint` on a wildcard host (any
        other host is connected to), `replay_endpoint` (always bound) on a host not loopback."""
        exposed = [self.endpoint] if tcp_host(self.endpoint) in WILDCARD_HOSTS else []
        replay = tcp_host(self.replay_endpoint)
        if replay is not None and not is_loopback_host(replay.strip("[]")):
            exposed.append(str(self.replay_endpoint))
        return exposed

    @property
    def enabled(self) -> bool:
        """Whether events are published (vLLM's: enabled, and the publisher is not "null")."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def _check_type(key: str, value: Any, kind: str) -> None:
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "str | None": value is None or isinstance(value, str),
    }[kind]
    if not ok:
        raise ValueError(f"kv_events_config: {key} must be {kind.replace(' | None', ' or null')}")


@dataclass(frozen=True, kw_only=True)
class CacheSettings(Settings):
    """The KV pool, the radix tree, and the host and disk tiers under it."""

    section: ClassVar[str] = "KV cache and memory tiers"
    # fmt: off
    max_total_tokens: int | None = setting(None, "KV slots in the token pool; overrides --mem-fraction")
    mem_fraction: float | None = setting(None, "fraction of free memory given to the KV pool when --max-total-tokens is not set (default: 0.8 on CUDA, 0.1 on CPU)")
    page_size: int = setting(1, "tokens per KV page; the radix tree matches whole pages")
    kv_cache_dtype: str = setting("auto", "what the KV pool stores: auto (the model's dtype) or one byte a value with a float32 scale per token and KV head: int8, fp8_e4m3 or fp8_e5m2 (about 4x the tokens of float32 KV in the same memory, 1.9x bfloat16's; not token-exact, quality-gated: docs/benchmarks.md), read by the torch backend on the CPU and the triton backend (CUDA's default); the host and disk tiers and swap keep that form; refused at start with the torch backend on CUDA and with --enable-deterministic-inference", choices=("auto", "int8", "fp8_e4m3", "fp8_e5m2"))
    disable_radix_cache: bool = setting(False, "turn prefix matching off (same code path, no reuse)")
    max_mamba_cache_size: int | None = setting(None, "state slots of a model whose layers carry a state per request (LFM2's convolutions): one per running request, the rest hold snapshots in the radix tree where prefixes resume (default: 2 x --max-running-requests, or fewer: as many as the KV pool's bytes hold)")
    mamba_ssm_dtype: str = setting("float32", "what a recurrent layer's state (Qwen3.5's Gated DeltaNet) is kept in between steps; it is computed in float32 either way (a convolution's state keeps the model's dtype)", choices=("float32", "bfloat16", "float16"))
    enable_hierarchical_cache: bool = setting(False, "keep prefixes evicted from the KV pool in host memory and load them back instead of recomputing them")
    hicache_ratio: float = setting(2.0, "host tier size as a multiple of the KV pool (unless --hicache-size)")
    hicache_size: float | None = setting(None, "host tier size in GB of KV; overrides --hicache-ratio")
    hicache_write_policy: str = setting("write_through_selective", "when a cached prefix is copied to the host: write_through (when cached), write_through_selective (from its second use, and when evicted while the host has free room) or write_back (when evicted from the pool)", choices=HICACHE_WRITE_POLICIES)
    hicache_storage_dir: str | None = setting(None, "a disk tier under the host tier: finished requests' KV blocks are written here as safetensors files and read back on a miss, across restarts, with a recurrent model's state snapshots where a block ends (needs --enable-hierarchical-cache); made 0700, and refused when another uid owns it or group or others may write it")
    hicache_storage_size: float = setting(16.0, "GB the disk tier may use; least recently used blocks are removed")
    preemption_mode: str | None = setting(None, "what a request retracted for lack of memory keeps: swap (its KV goes to the host tier and comes back) or recompute (default: swap with --enable-hierarchical-cache, else recompute)", choices=("recompute", "swap"))
    kv_events_config: str | None = setting(None, 'publish every page the radix tree stores, evicts or clears as KV-cache events over ZeroMQ, in vLLM\'s schema: vLLM\'s KVEventsConfig JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv@pod@model"}\' (keys: publisher, buffer_steps, hwm, max_queue_size too; docs/kv_events.md)')
    # fmt: on

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """`kv_events_config` parsed (None: not set)."""
        if self.kv_events_config is None:
            return None
        return KVEventsConfig.from_json(self.kv_events_config)

    def check(self) -> None:
        _ = self.kv_events  # parsed at start, so a bad --kv-events-config is refused then
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        _at_least_one(
            max_total_tokens=self.max_total_tokens, max_mamba_cache_size=self.max_mamba_cache_size
        )
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError("mem_fraction must be in (0, 1)")
        if self.hicache_ratio <= 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("hicache_ratio and hicache_size must be > 0")
        if self.hicache_storage_size <= 0:
            raise ValueError("hicache_storage_size must be > 0")
        if not self.enable_hierarchical_cache and (
            self.hicache_storage_dir is not None or self.preemption_mode == "swap"
        ):
            raise ValueError(
                "hicache_storage_dir and preemption_mode='swap' need enable_hierarchical_cache"
            )


@dataclass(frozen=True, kw_only=True)
class StructuredSettings(Settings):
    section: ClassVar[str] = "constrained decoding and tool calls"
    # grammar_backend's choices are structured/grammar.py's GRAMMAR_BACKENDS (config imports
    # nothing of radixrt)
    # fmt: off
    enable_jump_forward: bool = setting(True, "append text a constraint forces (JSON keys and punctuation) in one extend instead of decoding it token by token; --no-enable-jump-forward decodes every token")
    constraint_compile_timeout: float = setting(10.0, "seconds a constraint may take to compile; its worker process is then killed and the request ends with 'invalid_constraint' (too complex), a verdict kept for retries. A constraint also waits at most this long (1 s at least) for a worker, then ends with 'overloaded': every constraint is answered within twice this")
    constraint_compiles_per_tenant: int = setting(8, "expensive constraints (any a quick look does not judge cheap, and every llguidance grammar) one tenant may have compiling or waiting to compile at once (repeats of one count once); past it a new one is refused at once with 'overloaded'")
    grammar_backend: str = setting("outlines", "what compiles regex, JSON-schema, choices and dtype constraints: outlines-core (regex automata, built in killable processes) or llguidance (a grammar engine: JSON at any depth, schemas' numeric bounds); ebnf and lark grammars always use llguidance", choices=("outlines", "llguidance"))
    tool_call_parser: str = setting("auto", "how models write tool calls on /v1/chat/completions, and how they are read and constrained: hermes (<tool_call>{...}</tool_call>), llama3-json, mistral, pythonic, or auto (the chat template's format, else hermes)", choices=("auto", "hermes", "llama3-json", "mistral", "pythonic"))
    reasoning_parser: str | None = setting(None, "split a reasoning model's <think>...</think> from the answer into message.reasoning_content (streamed: delta.reasoning_content) on /v1/chat/completions: deepseek-r1 (the reply starts inside the block: the template opened it) or qwen3 (only a reply that starts with <think>); off when unset. With it, a request's constraint (response_format, a required tool call, a DSL regex or schema) applies from the token after </think>, and max_reasoning_tokens bounds the block", choices=REASONING_PARSER_NAMES)
    # fmt: on

    def check(self) -> None:
        if not self.constraint_compile_timeout > 0:
            raise ValueError("constraint_compile_timeout must be > 0 seconds")
        _at_least_one(constraint_compiles_per_tenant=self.constraint_compiles_per_tenant)


@dataclass(frozen=True, kw_only=True)
class SpeculativeSettings(Settings):
    section: ClassVar[str] = "speculative decoding"
    # fmt: off
    speculative_algorithm: str | None = setting(None, "ngram: each decoding request drafts the tokens that followed its last few tokens in finished requests or in its own prompt and output, and one forward verifies them (greedy output unchanged; off by default)", choices=("ngram",))
    speculative_num_draft_tokens: int = setting(8, "most tokens drafted per request and step with --speculative-algorithm; below it a request drafts only the tokens whose chance of acceptance pays for their row at the current batch size")
    # fmt: on

    def check(self) -> None:
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")


@dataclass(frozen=True, kw_only=True)
class LoraSettings(Settings):
    section: ClassVar[str] = "LoRA adapters"
    # fmt: off
    lora_paths: tuple[str, ...] = setting((), "LoRA adapters to load at start, as name=path (a folder holding peft's adapter_config.json and adapter_model.safetensors); requests name one with lora_path", nargs="+")
    enable_lora: bool = setting(False, "serve LoRA adapters even without --lora-paths (they are loaded at run time with load_lora_adapter)")
    max_loras_per_batch: int = setting(8, "device slots for adapters, and the most distinct adapters one batch holds (others wait; the least recently used adapter leaves its slot)")
    max_lora_rank: int | None = setting(None, "the largest adapter rank the pool takes (default: the largest of --lora-paths, else 16); a larger adapter is refused")
    # fmt: on

    @property
    def lora_enabled(self) -> bool:
        """Whether adapters are served: some given at start, or `--enable-lora`."""
        return self.enable_lora or bool(self.lora_paths)

    def check(self) -> None:
        if isinstance(self.lora_paths, dict):  # SGLang's form, {name: path}, as name=path entries
            entries = tuple(f"{name}={path}" for name, path in self.lora_paths.items())
            object.__setattr__(self, "lora_paths", entries)
        if self.max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        names = [entry.partition("=")[0] for entry in self.lora_paths]
        bad = [e for e in self.lora_paths if not all(e.partition("=")[::2])]
        if bad:
            raise ValueError(f"lora_paths takes name=path entries, not {bad[0]!r}")
        if len(set(names)) != len(names):
            raise ValueError("lora_paths names one adapter twice")


@dataclass(frozen=True, kw_only=True)
class PrioritySettings(Settings):
    section: ClassVar[str] = "priorities"
    # fmt: off
    schedule_low_priority_values_first: bool = setting(False, "a request's lower `priority` value runs first (default: higher first)")
    enable_priority_preemption: bool = setting(False, "retract running lower-priority requests when a higher-priority one cannot be admitted for lack of room")
    priority_aging_s: float = setting(10.0, "a waiting request gains one priority level per this many seconds, so a low-priority request outranks any higher one that arrives (gap x this) seconds after it")
    # fmt: on

    def check(self) -> None:
        if self.priority_aging_s <= 0:
            raise ValueError("priority_aging_s must be > 0")


@dataclass(frozen=True, kw_only=True)
class TenantLimits(Settings):
    """Tenants, priorities, limits: docs/protocol.md, "Tenants"."""

    section: ClassVar[str] = "per-tenant and per-client limits"
    # fmt: off
    max_inflight_per_tenant: int | None = setting(None, "requests one tenant (its API key; without a key file, one client connection) may have queued or running; past it, 'rate_limited' (default: with --api-key-file, a quarter of --max-queued-requests; else no limit)")
    max_pinned_tokens_per_client: int | None = setting(None, "cached prefix tokens one tenant (its API key; without a key file, one client connection) may hold pinned (a fork's shared prefix) at once; past it, a pin gets 'rate_limited' (default, and at most: the shared budget, --max-pinned-fraction)")
    max_pinned_fraction: float = setting(0.5, "the fraction of the KV pool all pins together may hold: past it, the pins of tenants holding more than their share (the budget over the tenants holding pins) are released, oldest first, else the pin gets 'rate_limited'; a request short of room while nothing runs releases pins held past a share (the budget over those tenants plus one), else gets 'overloaded'")
    max_pins_per_tenant: int = setting(256, "pins one tenant (its API key; without a key file, one client connection) may hold at once; past it, a pin gets 'rate_limited'")
    max_queued_tokens_per_tenant: int | None = setting(None, "prompt tokens one tenant may have waiting for admission; past it, 'rate_limited' (default: with --api-key-file, four times the KV pool; else no limit)")
    tenant_max_priority: int = setting(0, "the most urgent priority a request sent with a key other than the admin's may have when the key's line sets no maxprio: a more urgent one is clamped to it (the admin's and a keyless server's requests are not capped)")
    # fmt: on

    def check(self) -> None:
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError("max_pinned_fraction must be > 0 and at most 1")
        _at_least_one(
            max_inflight_per_tenant=self.max_inflight_per_tenant,
            max_pinned_tokens_per_client=self.max_pinned_tokens_per_client,
            max_pins_per_tenant=self.max_pins_per_tenant,
            max_queued_tokens_per_tenant=self.max_queued_tokens_per_tenant,
        )


SERVER_SECTION = "sockets, keys and limits"


@dataclass(frozen=True, kw_only=True)
class FrontSettings(Settings):
    """The client-facing socket's address and limits, in `serve` and in `radixrt router` alike."""

    section: ClassVar[str] = SERVER_SECTION
    # fmt: off
    host: str = setting("127.0.0.1", "address to bind; loopback unless told otherwise")
    max_frame_bytes: int = setting(16 << 20, "the largest frame a client may send: a longer one drops its connection (ZMQ_MAXMSGSIZE), and msgpack containers and strings are bounded before they are built")
    max_prompt_bytes: int = setting(1 << 22, "a generate whose text (UTF-8 bytes) or input_ids (4 bytes each) is larger gets 'invalid_request' before it is tokenized")
    drain_timeout: float = setting(30.0, "on SIGTERM: refuse new requests ('draining'), let queued and running ones finish for at most this many seconds, abort the rest, exit 0")
    # fmt: on

    def check(self) -> None:
        if self.max_frame_bytes < MIN_FRAME_BYTES or self.max_prompt_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= {MIN_FRAME_BYTES}, max_prompt_bytes >= 1")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")


@dataclass(frozen=True, kw_only=True)
class KeySettings(Settings):
    """Who may connect and as which tenant, in `serve` and in `radixrt router` alike."""

    section: ClassVar[str] = SERVER_SECTION
    # fmt: off
    api_key_file: str | None = setting(None, "a file of 'tenant:key' or 'tenant:key:maxprio' lines: each key is accepted and names its tenant, whose requests share only that tenant's prefix cache and whose priority is capped at maxprio (read as a cap only when the text after the key's last colon is an integer); with --api-key too, that key is the default tenant's")
    api_key: str | None = setting(None, "required in every message when set; needed to bind a non-loopback host")
    curve_secret_key: str | None = setting(None, "Z85 CURVE secret key: encrypt and authenticate the socket (clients need the public key); or set RADIXRT_CURVE_SECRET_KEY")
    admin_api_key: str | None = setting(None, "the key of control ops (shutdown, flush_cache, memory_snapshot, check_invariants) and of every tenant's stats; a tenant key gets 'unauthorized' (a lone --api-key without --api-key-file stays the admin); or set RADIXRT_ADMIN_API_KEY")
    curve_client_keys: str | None = setting(None, "a file of client CURVE public keys (Z85, one a line): only these may connect (checked through ZAP; needs --curve-secret-key)")
    # fmt: on

    def with_own_admin_key(self: K) -> K:
        """These settings with an admin key where a key file names the tenants and no admin key
        is given: a random one, which only the launcher (`rt.Runtime`, `rt.Engine`) and the
        processes `serve` starts hold (its HTTP gateway, a fleet's router and workers: secrets
        travel by environment). Their own calls then run as the admin, never as a tenant of the
        file: `health`, and `model_info` with the paths the gateway and the router load the
        tokenizer from, which no tenant sees. No client's role changes. Without a key file
        nothing changes (no key: everyone is the admin; a lone --api-key is)."""
        if not self.api_key_file or self.admin_api_key:
            return self
        return dataclasses.replace(self, admin_api_key=secrets.token_urlsafe(32))


@dataclass(frozen=True, kw_only=True)
class ServePorts(Settings):
    """`radixrt serve`'s ports: HTTP on `port`, ZeroMQ on `zmq_port`."""

    section: ClassVar[str] = SERVER_SECTION
    # fmt: off
    port: int = setting(30000, "TCP port of the HTTP API (OpenAI /v1/*, SGLang's native /generate, /flush_cache, ..., /metrics) on --host")
    zmq_port: int | None = setting(None, "TCP port of the ZeroMQ ROUTER socket (docs/protocol.md; default: --port + 1)")
    disable_http: bool = setting(False, "serve only the ZeroMQ protocol: no HTTP gateway on --port")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class RouterPorts(Settings):
    """`radixrt router`'s ports. Its `port` is not serve's: the clients' ZeroMQ port
    (DESIGN.md), where serve's is HTTP."""

    section: ClassVar[str] = SERVER_SECTION
    # fmt: off
    port: int = setting(30001, "the clients' ZeroMQ port (the router serves no HTTP)")
    metrics_port: int | None = setting(None, "serve GET /metrics (Prometheus text: the workers' series, each labelled worker=, and the router's own) over HTTP on --host at this port; with keys configured it needs the admin key as a Bearer token")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class HttpSettings(Settings):
    """What the HTTP gateway bounds besides the body: the wait for one request, a pin's lease."""

    section: ClassVar[str] = SERVER_SECTION
    # fmt: off
    http_request_timeout: float = setting(600.0, "the HTTP gateway's bound on one request, in seconds: a request whose timeout is unset or longer gets this one (the runtime ends it with 'timeout'), and one the runtime has not answered a few seconds past it is answered 504 'timeout' by the gateway and aborted")
    http_pin_lease: float = setting(600.0, "seconds a pin made through the HTTP gateway (/pin) holds unless /unpin comes first; then the gateway unpins it (each caller's pins are its own and count under its key's tenant)")
    http_cpu_threads: int = setting(4, "threads of the HTTP gateway for tokenizing, chat templates, tool schemas and echoes, off its event loop: one is kept for small requests, and one tenant's large ones take at most half the rest; as many processes render chat templates, half of them at most one tenant's")
    chat_template_timeout: float = setting(5.0, "seconds the chat template may take to render one request's messages (in a process of the HTTP gateway's, which is then killed and replaced): past it the request gets 'invalid_request' naming this limit. The template's output is bounded by --max-prompt-bytes")
    allowed_hosts: tuple[str, ...] = setting((), "Host names a server without keys answers besides its bound address's (loopback's names when bound there): any other Host gets 403, which stops DNS-rebinding pages ('*': any)", nargs="+")
    allowed_origins: tuple[str, ...] = setting((), "browser Origins (scheme://host[:port]) a server without keys answers besides its own names: a request another site's page sends gets 403 ('*': any)", nargs="+")
    max_stored_response_bytes_per_tenant: int = setting(64 << 20, "bytes of stored /v1/responses one tenant (its API key) may hold, the earlier turns a stored response continues (previous_response_id) included: past it the tenant's oldest go first, and a conversation that alone would hold more is refused ('invalid_request'; store: false is not stored)")
    max_stored_response_bytes: int = setting(1 << 30, "bytes of stored /v1/responses all tenants together may hold: past it the oldest response of the tenant holding the most goes first")
    # fmt: on

    def check(self) -> None:
        if not self.http_request_timeout > 0 or not self.http_pin_lease > 0:
            raise ValueError("http_request_timeout and http_pin_lease must be > 0 seconds")
        if not self.chat_template_timeout > 0:
            raise ValueError("chat_template_timeout must be > 0 seconds")
        if not 0 < self.max_stored_response_bytes_per_tenant <= self.max_stored_response_bytes:
            raise ValueError(
                "max_stored_response_bytes_per_tenant must be > 0 and at most max_stored_response_bytes"
            )
        if self.http_cpu_threads < 2:
            raise ValueError("http_cpu_threads must be >= 2 (one is kept for small requests)")


@dataclass(frozen=True, kw_only=True)
class ImageSettings(Settings):
    """What a request's images may be, checked from their bytes and headers before any is
    decoded (radixrt/multimodal/images.py); the names are vLLM's."""

    section: ClassVar[str] = "images"
    # fmt: off
    limit_mm_per_prompt: str = setting(json.dumps({"image": IMAGES_PER_PROMPT}), 'the most items of each modality one request may carry, as vLLM\'s JSON (\'{"image": 4}\'; 0 refuses them): a request with more is refused (\'invalid_request\') before any is decoded. Images are the one modality served')
    max_image_bytes: int = setting(20 << 20, "the largest image, in encoded bytes (base64 is measured before it is decoded; a remote image is cut off past it while it streams): a larger one is refused ('invalid_request')")
    max_image_pixels: int = setting(1 << 25, f"the most pixels (width x height, read from the image's header) one image may have, about 100 MiB decoded as RGB: a larger one, a decompression bomb too, is refused ('invalid_request') before anything is allocated for it, as is one with a side under {MIN_IMAGE_SIDE}")
    allowed_media_domains: tuple[str, ...] = setting((), f"hosts whose http:// and https:// image URLs a request may name; such an image is fetched only when every address its host resolves to is public (no private, loopback, link-local, multicast or reserved one), checked again at each of at most {MAX_MEDIA_REDIRECTS} redirects, within {MEDIA_FETCH_TIMEOUT_S:g} s and --max-image-bytes. Empty (the default): every remote URL is refused. A request's local path or file:// URL is never read", nargs="+")
    # fmt: on

    @property
    def max_images(self) -> int:
        """Images one request may carry: `limit_mm_per_prompt`'s "image", IMAGES_PER_PROMPT
        when it names other modalities only (vLLM's rule; vLLM's default is 999)."""
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError:
            limits = None
        if not isinstance(limits, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values()
        ):
            raise ValueError(
                f"limit_mm_per_prompt takes JSON like '{{\"image\": 4}}' (counts >= 0), not "
                f"{self.limit_mm_per_prompt!r}"
            )
        return int(limits.get("image", IMAGES_PER_PROMPT))

    def check(self) -> None:
        _ = self.max_images  # parsed at start, so a bad --limit-mm-per-prompt is refused then
        _at_least_one(max_image_bytes=self.max_image_bytes, max_image_pixels=self.max_image_pixels)
        bad = [h for h in self.allowed_media_domains if not h or any(c in h for c in "/:@*")]
        if bad:
            raise ValueError(
                f"allowed_media_domains takes host names (images.example.com), not {bad[0]!r}"
            )


@dataclass(frozen=True, kw_only=True)
class LoggingSettings(Settings):
    section: ClassVar[str] = "logging"
    # fmt: off
    log_level: str = setting("info", "debug, info, warning or error")
    # fmt: on


# ---- the commands' settings -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ServerArgs(
    ModelSettings,
    ParallelSettings,
    RouterSettings,
    BatchSettings,
    CacheSettings,
    StructuredSettings,
    SpeculativeSettings,
    LoraSettings,
    PrioritySettings,
    TenantLimits,
    FrontSettings,
    ServePorts,
    KeySettings,
    HttpSettings,
    ImageSettings,
    LoggingSettings,
):
    """Every setting of `radixrt serve`, `rt.Engine` and `rt.Runtime`: its groups', flat."""

    def check(self) -> None:
        if self.dp_size > 1 and self.kv_events_config is not None:
            raise ValueError(
                "kv_events_config with dp_size > 1: each worker needs its own endpoint; start "
                "the workers with their own --kv-events-config behind `radixrt router`"
            )
        if self.tp_size > 1 and self.enable_hierarchical_cache:
            raise ValueError("the host tier does not run with tp_size > 1 yet")
        if self.curve_client_keys and not self.disable_http:
            raise ValueError(
                "curve_client_keys needs disable_http: the HTTP gateway's link is not on the list yet"
            )

    @property
    def model_name(self) -> str:
        """What the model is called to clients: --served-model-name, else --model as given,
        but a path on this machine (absolute, or a file or folder here) by its last part: a
        tenant never sees a server path."""
        if self.served_model_name:
            return self.served_model_name
        path = os.path.expanduser(self.model)
        if os.path.isabs(path) or os.path.exists(path):
            return os.path.basename(os.path.abspath(path))
        return self.model

    @property
    def executor(self) -> ExecutorArgs:
        return ExecutorArgs.of(self)

    @property
    def scheduler(self) -> SchedulerArgs:
        return SchedulerArgs.of(self)

    @property
    def endpoint(self) -> str:
        """ZeroMQ address to bind: `--host` may itself be an ipc:// path."""
        return endpoint_of(self.host, self.zmq_port_or_default)

    @property
    def zmq_port_or_default(self) -> int:
        """The ZeroMQ port: `--zmq-port`, else `--port` + 1 (SGLang's HTTP port stays HTTP)."""
        return self.zmq_port if self.zmq_port is not None else self.port + 1

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def http_host(self) -> str:
        """Where the HTTP API listens (on `--port`): `--host`, or loopback when that is an ipc://
        path."""
        return "127.0.0.1" if self.host.startswith("ipc://") else self.host


@dataclass(frozen=True, kw_only=True)
class RouterArgs(
    RouterSettings, WorkerSettings, FrontSettings, RouterPorts, KeySettings, LoggingSettings
):
    """The flags of `radixrt router`: one client-facing socket over several `radixrt serve`
    workers. The groups it shares with `serve` are serve's (same flags, defaults and help)."""

    aliases: ClassVar[dict[str, tuple[str, ...]]] = {
        "router_policy": ("--policy",)  # the name DESIGN.md gives `radixrt router`'s flag
    }

    def check(self) -> None:
        if not self.worker:
            raise ValueError("a router needs at least one --worker")

    @property
    def endpoint(self) -> str:
        """ZeroMQ address the clients' socket binds."""
        return endpoint_of(self.host, self.port)


# ---- what components receive --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ExecutorArgs(ModelSettings, ParallelSettings, CacheSettings, BatchSettings, LoraSettings):
    """What the model runner and its tensor-parallel ranks need: which weights, where, how large
    a KV pool and request table, and which adapters."""


@dataclass(frozen=True, kw_only=True)
class SchedulerArgs(
    ModelSettings,
    BatchSettings,
    CacheSettings,
    StructuredSettings,
    SpeculativeSettings,
    LoraSettings,
    PrioritySettings,
    TenantLimits,
):
    """What the scheduler needs: batching, caching, constraints, drafts, adapters, priorities,
    the per-tenant limits it enforces, and whose sampling defaults apply (the model's
    `generation_config`)."""


@dataclass(frozen=True, kw_only=True)
class GatewaySettings(FrontSettings, HttpSettings, ImageSettings):
    """What the HTTP gateway bounds: a body (and the frame it packs to: the runtime's
    `max_frame_bytes`), the wait for one request, a pin's lease, the images it decodes."""
