"""Server settings: one dataclass shared by the CLI, `rt.Engine` and `rt.Runtime`.

`ServerArgs` is what users set (flags, keywords); it is frozen, so nothing changes it after launch
(launchers make a new one with `dataclasses.replace`). Its fields stay flat (one flag, one
keyword each), and each field's metadata names its feature group (`GROUP_TITLES`): `--help`
lists the flags by group, and each group that has rules is a frozen dataclass that checks them
when it is built (`CacheSettings`, `SpeculativeSettings`, ...; `ServerArgs.group(cls)` builds
one, and building `ServerArgs` builds them all). `RouterArgs`, the flags of `radixrt router`,
is generated the same way and takes the settings it shares with `serve` from `ServerArgs`'s own
fields, so one setting has one flag name, default and help in both.

Each component receives only its part: `ExecutorArgs` (the model and its pools),
`SchedulerArgs` (batching and caching); the server keeps the rest (addresses, keys, queue
limits).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from radixrt.mem_cache.kv_events import KVEventsConfig

SECRETS = {
    "api_key": "RADIXRT_API_KEY",
    "admin_api_key": "RADIXRT_ADMIN_API_KEY",
    "curve_secret_key": "RADIXRT_CURVE_SECRET_KEY",
}  # field -> env var


@dataclass(frozen=True)
class ExecutorArgs:
    """What the model runner needs: which weights, where, and how large a KV pool."""

    model: str
    tokenizer_path: str | None
    chat_template: str | None
    dtype: str
    device: str
    attention_backend: str
    quantization: str | None
    cpu_isa: str
    disable_cuda_graph: bool
    max_total_tokens: int | None
    mem_fraction: float | None
    page_size: int
    context_length: int | None
    max_running_requests: int  # sizes the request->token table
    tp_size: int
    ep_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    lora_paths: tuple[str, ...]  # name=path entries
    enable_lora: bool
    max_loras_per_batch: int
    max_lora_rank: int | None

    @property
    def lora_enabled(self) -> bool:
        """Whether adapters are served: some given at start, or `--enable-lora`."""
        return self.enable_lora or bool(self.lora_paths)


@dataclass(frozen=True)
class SchedulerArgs:
    """What the scheduler needs: batching, chunking, cache and sampling-seed settings."""

    schedule_policy: str
    schedule_mode: str
    chunked_prefill_size: int
    max_prefill_tokens: int
    max_running_requests: int
    disable_radix_cache: bool
    enable_jump_forward: bool
    constraint_compile_timeout: float
    constraint_compiles_per_tenant: int
    grammar_backend: str
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: float | None
    hicache_write_policy: str
    hicache_storage_dir: str | None
    hicache_storage_size: float
    preemption_mode: str | None
    kv_events_config: str | None
    random_seed: int
    log_interval: int
    schedule_low_priority_values_first: bool
    enable_priority_preemption: bool
    priority_aging_s: float
    max_pinned_tokens_per_client: int | None
    max_pins_per_tenant: int
    max_prompt_logprob_entries: int
    generation_config: str  # whose sampling defaults a request's unset parameters take
    max_loras_per_batch: int  # distinct adapters one batch may hold


MIN_FRAME_BYTES = 4096  # a smaller frame limit would refuse ordinary requests
REASONING_PARSER_NAMES = ("deepseek-r1", "qwen3")  # server/http/reasoning.py has each one
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ROUTER_POLICIES = ("cache-aware", "round-robin", "shortest-queue")

# group name (a field's metadata "group") -> its section title in `--help`, in --help's order
GROUP_TITLES = {
    "model": "model and weights",
    "parallel": "tensor and data parallelism",
    "router": "routing over data-parallel workers (`serve --dp-size`, `radixrt router`)",
    "workers": "the router's workers (with --api-key-file, each client's key is forwarded, so the workers need the same file)",
    "batching": "scheduling and batching",
    "cache": "KV cache and memory tiers",
    "structured": "constrained decoding and tool calls",
    "speculative": "speculative decoding",
    "lora": "LoRA adapters",
    "priority": "priorities",
    "tenants": "per-tenant and per-client limits",
    "server": "sockets, keys and limits",
    "logging": "logging",
}


def is_loopback_host(host: str) -> bool:
    """An ipc:// path or a loopback address: reachable from this machine only."""
    return host.startswith("ipc://") or host in ("127.0.0.1", "localhost", "::1")


def _part(cls: type, args: Any) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def endpoint_of(host: str, port: int) -> str:
    """ZeroMQ address to bind: `host` may itself be an ipc:// path."""
    return host if host.startswith("ipc://") else f"tcp://{host}:{port}"


# ---- feature groups: each checks its own rules when built ------------------------------------
G = TypeVar("G", bound="SettingsGroup")


class SettingsGroup:
    """A frozen dataclass of some settings of one group (`name`), under their flat names, built
    from `ServerArgs` (or `RouterArgs`) by `of`; its `__post_init__` holds that group's rules.
    Choices (a field's metadata "choices") are checked by `Settings` for every field."""

    name: ClassVar[str]

    @classmethod
    def of(cls: type[G], settings: Any) -> G:
        return _part(cls, settings)

    @classmethod
    def defaults(cls: type[G]) -> G:
        """The group at `ServerArgs`'s defaults."""
        return cls.of(ServerArgs())

    @classmethod
    def fits(cls, settings: type) -> bool:
        """Whether a settings class has every field of this group."""
        names = {f.name for f in dataclasses.fields(settings)}
        return all(f.name in names for f in dataclasses.fields(cls))


def _at_least_one(**values: int | None) -> None:
    """Each value unset (None) or >= 1; else a ValueError naming it."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True)
class ParallelSettings(SettingsGroup):
    name: ClassVar[str] = "parallel"
    tp_size: int
    ep_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    dp_size: int

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class RouterSettings(SettingsGroup):
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

    name: ClassVar[str] = "router"
    router_policy: str
    router_cache_threshold: float
    router_balance_abs_threshold: int
    router_balance_rel_threshold: float

    def __post_init__(self) -> None:
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError("router_cache_threshold must be in [0, 1]")
        if self.router_balance_abs_threshold < 0 or self.router_balance_rel_threshold < 1:
            raise ValueError(
                "router_balance_abs_threshold must be >= 0, router_balance_rel_threshold >= 1"
            )


@dataclass(frozen=True)
class BatchSettings(SettingsGroup):
    name: ClassVar[str] = "batching"
    max_running_requests: int
    max_prefill_tokens: int
    max_queued_requests: int
    max_prompt_logprob_entries: int

    def __post_init__(self) -> None:
        _at_least_one(**dataclasses.asdict(self))


@dataclass(frozen=True)
class CacheSettings(SettingsGroup):
    """The KV pool, the radix tree, and the host and disk tiers under it."""

    name: ClassVar[str] = "cache"
    max_total_tokens: int | None
    mem_fraction: float | None
    page_size: int
    disable_radix_cache: bool
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: float | None
    hicache_write_policy: str
    hicache_storage_dir: str | None
    hicache_storage_size: float
    preemption_mode: str | None
    kv_events_config: str | None

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        _at_least_one(max_total_tokens=self.max_total_tokens)
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


@dataclass(frozen=True)
class StructuredSettings(SettingsGroup):
    name: ClassVar[str] = "structured"
    enable_jump_forward: bool
    constraint_compile_timeout: float
    constraint_compiles_per_tenant: int
    grammar_backend: str

    def __post_init__(self) -> None:
        if not self.constraint_compile_timeout > 0:
            raise ValueError("constraint_compile_timeout must be > 0 seconds")
        _at_least_one(constraint_compiles_per_tenant=self.constraint_compiles_per_tenant)


@dataclass(frozen=True)
class SpeculativeSettings(SettingsGroup):
    name: ClassVar[str] = "speculative"
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int

    def __post_init__(self) -> None:
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")


@dataclass(frozen=True)
class LoraSettings(SettingsGroup):
    name: ClassVar[str] = "lora"
    lora_paths: tuple[str, ...]
    max_loras_per_batch: int
    max_lora_rank: int | None

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class PrioritySettings(SettingsGroup):
    name: ClassVar[str] = "priority"
    schedule_low_priority_values_first: bool
    enable_priority_preemption: bool
    priority_aging_s: float

    def __post_init__(self) -> None:
        if self.priority_aging_s <= 0:
            raise ValueError("priority_aging_s must be > 0")


@dataclass(frozen=True)
class TenantLimits(SettingsGroup):
    name: ClassVar[str] = "tenants"
    max_inflight_per_tenant: int | None
    max_pinned_tokens_per_client: int | None
    max_pins_per_tenant: int
    max_queued_tokens_per_tenant: int | None
    tenant_max_priority: int

    def __post_init__(self) -> None:
        _at_least_one(
            **{k: v for k, v in dataclasses.asdict(self).items() if k != "tenant_max_priority"}
        )


@dataclass(frozen=True)
class FrontSettings(SettingsGroup):
    """The client-facing socket's limits, in `serve` and in `radixrt router` alike."""

    name: ClassVar[str] = "server"
    host: str
    port: int
    max_frame_bytes: int
    max_prompt_bytes: int
    drain_timeout: float

    def __post_init__(self) -> None:
        if self.max_frame_bytes < MIN_FRAME_BYTES or self.max_prompt_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= {MIN_FRAME_BYTES}, max_prompt_bytes >= 1")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")


@dataclass(frozen=True)
class GatewaySettings(SettingsGroup):
    """What the HTTP gateway bounds: a body (and the frame it packs to: the runtime's
    `max_frame_bytes`), the wait for one request, a pin's lease."""

    name: ClassVar[str] = "server"
    max_frame_bytes: int
    http_request_timeout: float
    http_pin_lease: float

    def __post_init__(self) -> None:
        if not self.http_request_timeout > 0 or not self.http_pin_lease > 0:
            raise ValueError("http_request_timeout and http_pin_lease must be > 0 seconds")


GROUPS: tuple[type[SettingsGroup], ...] = (
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
    GatewaySettings,
)


# ---- a command line generated from a settings dataclass --------------------------------------
def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _repeated(f: dataclasses.Field) -> bool:
    """A field given once per value (`--worker A --worker B`), held as a tuple."""
    return str(f.type).startswith("tuple")


def _add_flag(parser: Any, f: dataclasses.Field) -> None:
    names = [_flag(f), *f.metadata.get("aliases", ())]
    helptext = f.metadata.get("help", "")
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


S = TypeVar("S", bound="Settings")


class Settings:
    """What `ServerArgs`, `RouterArgs` and the bench's `BenchConfig` share: flags generated from
    the fields (each field's metadata: "group", "help", optional "choices" and "aliases"),
    grouped as the class's `group_titles` orders them; keywords; the command line that recreates
    them; secrets from the environment; and the feature groups that fit them, each built (so
    checked) with the settings."""

    group_titles: ClassVar[dict[str, str]] = GROUP_TITLES  # a field's "group" -> its section

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, not {value!r}")
        for group in self.group_classes():
            group.of(self)

    @classmethod
    def group_classes(cls) -> list[type[SettingsGroup]]:
        return [g for g in GROUPS if g.fits(cls)]

    def group(self, cls: type[G]) -> G:
        """One feature group of these settings (e.g. `args.group(CacheSettings)`)."""
        return cls.of(self)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, in one argument group per feature group (`--help` shows them)."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        ungrouped = [f.name for f in fields if f.metadata.get("group") not in cls.group_titles]
        if ungrouped:  # a new setting must say where it belongs
            raise TypeError(
                f"settings with no group of {cls.__name__}.group_titles in their metadata: {ungrouped}"
            )
        for name, title in cls.group_titles.items():
            members = [f for f in fields if f.metadata["group"] == name]
            if members:
                section = parser.add_argument_group(title)
                for f in members:
                    _add_flag(section, f)

    @classmethod
    def from_cli_args(cls: type[S], args: argparse.Namespace) -> S:
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = getattr(args, f.name)
            values[f.name] = tuple(value or ()) if _repeated(f) else value
        return cls(**values)

    @classmethod
    def from_kwargs(cls: type[S], **kwargs: Any) -> S:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown server arguments: {sorted(unknown)}")
        return cls(**kwargs)

    def to_cli_args(self) -> list[str]:
        """The flags that recreate these settings on a command line (secrets excepted: they
        travel by environment)."""
        argv = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
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


@dataclass(frozen=True)
class ServerArgs(Settings):
    """Every setting of `radixrt serve`, `rt.Engine` and `rt.Runtime`, flat. A field's
    metadata: "group" (a key of `GROUP_TITLES`: where `--help` lists it, and which
    `SettingsGroup` owns its rules), "help", and "choices" where it has a closed set."""

    model: str = field(
        default="default",
        metadata={
            "group": "model",
            "help": "'default' (SmolLM2-135M-Instruct), a Hugging Face model folder, a .gguf file, or a Hugging Face Hub id already in the local Hub cache (needs huggingface_hub; nothing is downloaded)",
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "the model's name in the OpenAI API (/v1/models, each response's `model`) and in model_info (default: --model as given)",
        },
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "the tokenizer's folder or Hugging Face Hub id, when it is not the model's (default: --model)",
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "the chat template to use instead of the tokenizer's: a file holding a Jinja template, or the template itself",
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"group": "server", "help": "address to bind; loopback unless told otherwise"},
    )
    port: int = field(
        default=30000,
        metadata={
            "group": "server",
            "help": "TCP port of the HTTP API (OpenAI /v1/*, SGLang's native /generate, /flush_cache, ..., /metrics) on --host",
        },
    )
    zmq_port: int | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "TCP port of the ZeroMQ ROUTER socket (docs/protocol.md; default: --port + 1)",
        },
    )
    disable_http: bool = field(
        default=False,
        metadata={
            "group": "server",
            "help": "serve only the ZeroMQ protocol: no HTTP gateway on --port",
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "group": "model",
            "help": "auto (triton on CUDA, torch on CPU), torch or triton",
            "choices": ["auto", "torch", "triton"],
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "group": "model",
            "help": "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    device: str = field(default="auto", metadata={"group": "model", "help": "auto, cpu or cuda"})
    quantization: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "weight-only linears on CPUs with AVX2 (opt-in, quality-gated, not token-exact):"
            " int8 (per channel); int4 (groups of 32; a GGUF model's Q4_0/Q4_1/Q8_0 tensors are"
            " used as stored); gguf (a GGUF model's Q4_0/Q4_1/Q8_0 tensors as stored, the rest"
            " float)",
            "choices": ["int8", "int4", "gguf"],
        },
    )
    cpu_isa: str = field(
        default="auto",
        metadata={
            "group": "model",
            "help": "the instruction-set path of the CPU's quantized linears (--quantization):"
            " auto (the best this CPU runs; torch, with a warning, on a CPU without AVX2); avx2"
            " (the C kernels); torch (the packed weights dequantized on every call: slow, any"
            " CPU); avx512-vnni and amx are named for the paths to come and refused (the CPU"
            " lacks them, or they are not built yet). Naming a path this CPU cannot run is"
            " refused at start; model_info and the start-up log name the path taken",
            "choices": ["auto", "avx2", "torch", "avx512-vnni", "amx"],
        },
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata={
            "group": "model",
            "help": "on CUDA, launch every decode step's kernels instead of replaying graphs",
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "group": "model",
            "help": "auto: the model's generation_config.json gives the sampling defaults a request does not set (docs/protocol.md); ignore: radixrt's own",
            "choices": ["auto", "ignore"],
        },
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata={"group": "cache", "help": "KV slots in the token pool; overrides --mem-fraction"},
    )
    mem_fraction: float | None = field(
        default=None,
        metadata={
            "group": "cache",
            "help": "fraction of free memory given to the KV pool when --max-total-tokens is not set (default: 0.8 on CUDA, 0.1 on CPU)",
        },
    )
    page_size: int = field(
        default=1,
        metadata={
            "group": "cache",
            "help": "tokens per KV page; the radix tree matches whole pages",
        },
    )
    context_length: int | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "max prompt+output tokens per request (default: the model's)",
        },
    )
    tp_size: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "tensor parallelism: shard the model's heads, MLP and vocabulary over this many rank processes (one GPU each on CUDA, cores/N threads each on the CPU), gloo on the CPU, NCCL on CUDA",
        },
    )
    ep_size: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "expert parallelism over the --tp-size ranks (1 or --tp-size): each rank holds a share of a mixture-of-experts model's experts whole, instead of a slice of every expert",
        },
    )
    nnodes: int = field(
        default=1,
        metadata={"group": "parallel", "help": "machines the --tp-size ranks are spread over"},
    )
    node_rank: int = field(
        default=0,
        metadata={
            "group": "parallel",
            "help": "this machine's index among --nnodes: 0 runs the scheduler and the socket, the others only host ranks",
        },
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata={
            "group": "parallel",
            "help": "HOST:PORT where the ranks meet (torch.distributed TCP rendezvous; needed with --nnodes > 1; default: a free loopback port)",
        },
    )
    dp_size: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "data parallelism: this many workers (a share of the cores each on the CPU, their own GPUs on CUDA) behind a router on --host and the ZeroMQ port (--zmq-port), the HTTP gateway in front of it on --port",
        },
    )
    router_policy: str = field(
        default="cache-aware",
        metadata={
            "group": "router",
            "help": "cache-aware (the worker whose cache holds the longest prefix, unless load is out of balance), round-robin or shortest-queue",
            "choices": ROUTER_POLICIES,
        },
    )
    router_cache_threshold: float = field(
        default=0.5,  # RouterSettings says why this value and the next two
        metadata={
            "group": "router",
            "help": "cache-aware: route by match only when it covers at least this share of the prompt",
        },
    )
    router_balance_abs_threshold: int = field(
        default=4,
        metadata={
            "group": "router",
            "help": "cache-aware: load is out of balance when the busiest worker has this many more sequences than the idlest...",
        },
    )
    router_balance_rel_threshold: float = field(
        default=1.25,
        metadata={
            "group": "router",
            "help": "...and more than this many times as many; then the idlest gets it",
        },
    )
    schedule_policy: str = field(
        default="lpm",
        metadata={
            "group": "batching",
            "help": "lpm (longest prefix match), fcfs or dfs-weight",
            "choices": ["lpm", "fcfs", "dfs-weight"],
        },
    )
    schedule_mode: str = field(
        default="continuous",
        metadata={
            "group": "batching",
            "help": "continuous (requests join and leave at every step) or static (a new batch is admitted only once the previous one has fully finished: the baseline continuous batching is measured against)",
            "choices": ["continuous", "static"],
        },
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata={
            "group": "batching",
            "help": "max prompt tokens per step (of one request and of all together); longer prompts are prefilled in chunks, so decodes are never stalled behind a long prefill (<=0 disables chunking)",
        },
    )
    max_prefill_tokens: int = field(
        default=8192,
        metadata={
            "group": "batching",
            "help": "max new prompt tokens admitted per step over all requests",
        },
    )
    max_running_requests: int = field(
        default=256, metadata={"group": "batching", "help": "max requests decoding at once"}
    )
    disable_radix_cache: bool = field(
        default=False,
        metadata={"group": "cache", "help": "turn prefix matching off (same code path, no reuse)"},
    )
    enable_jump_forward: bool = field(
        default=True,
        metadata={
            "group": "structured",
            "help": "append text a constraint forces (JSON keys and punctuation) in one extend instead of decoding it token by token; --no-enable-jump-forward decodes every token",
        },
    )
    constraint_compile_timeout: float = field(
        default=10.0,
        metadata={
            "group": "structured",
            "help": "seconds a constraint may take to compile; its worker process is then killed and the request ends with 'invalid_constraint' (too complex), a verdict kept for retries. A constraint also waits at most this long (1 s at least) for a worker, then ends with 'overloaded': every constraint is answered within twice this",
        },
    )
    constraint_compiles_per_tenant: int = field(
        default=8,
        metadata={
            "group": "structured",
            "help": "expensive constraints (any a quick look does not judge cheap, and every llguidance grammar) one tenant may have compiling or waiting to compile at once (repeats of one count once); past it a new one is refused at once with 'overloaded'",
        },
    )
    grammar_backend: str = field(
        default="outlines",
        metadata={
            "group": "structured",
            # structured/grammar.py's GRAMMAR_BACKENDS (config imports nothing of radixrt)
            "choices": ["outlines", "llguidance"],
            "help": "what compiles regex, JSON-schema, choices and dtype constraints: outlines-core (regex automata, built in killable processes) or llguidance (a grammar engine: JSON at any depth, schemas' numeric bounds); ebnf and lark grammars always use llguidance",
        },
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata={
            "group": "speculative",
            "help": "ngram: each decoding request drafts the tokens that followed its last few tokens in finished requests or in its own prompt and output, and one forward verifies them (greedy output unchanged; off by default)",
            "choices": ["ngram"],
        },
    )
    speculative_num_draft_tokens: int = field(
        default=8,
        metadata={
            "group": "speculative",
            "help": "most tokens drafted per request and step with --speculative-algorithm; below it a request drafts only the tokens whose chance of acceptance pays for their row at the current batch size",
        },
    )
    lora_paths: tuple[str, ...] = field(
        default=(),
        metadata={
            "group": "lora",
            "nargs": "+",
            "help": "LoRA adapters to load at start, as name=path (a folder holding peft's adapter_config.json and adapter_model.safetensors); requests name one with lora_path",
        },
    )
    enable_lora: bool = field(
        default=False,
        metadata={
            "group": "lora",
            "help": "serve LoRA adapters even without --lora-paths (they are loaded at run time with load_lora_adapter)",
        },
    )
    max_loras_per_batch: int = field(
        default=8,
        metadata={
            "group": "lora",
            "help": "device slots for adapters, and the most distinct adapters one batch holds (others wait; the least recently used adapter leaves its slot)",
        },
    )
    max_lora_rank: int | None = field(
        default=None,
        metadata={
            "group": "lora",
            "help": "the largest adapter rank the pool takes (default: the largest of --lora-paths, else 16); a larger adapter is refused",
        },
    )
    enable_hierarchical_cache: bool = field(
        default=False,
        metadata={
            "group": "cache",
            "help": "keep prefixes evicted from the KV pool in host memory and load them back instead of recomputing them",
        },
    )
    hicache_ratio: float = field(
        default=2.0,
        metadata={
            "group": "cache",
            "help": "host tier size as a multiple of the KV pool (unless --hicache-size)",
        },
    )
    hicache_size: float | None = field(
        default=None,
        metadata={
            "group": "cache",
            "help": "host tier size in GB of KV; overrides --hicache-ratio",
        },
    )
    hicache_write_policy: str = field(
        default="write_through_selective",
        metadata={
            "group": "cache",
            "help": "when a cached prefix is copied to the host: write_through (when cached), write_through_selective (from its second use, and when evicted while the host has free room) or write_back (when evicted from the pool)",
            "choices": HICACHE_WRITE_POLICIES,
        },
    )
    hicache_storage_dir: str | None = field(
        default=None,
        metadata={
            "group": "cache",
            "help": "a disk tier under the host tier: finished requests' KV blocks are written here as safetensors files and read back on a miss, across restarts (needs --enable-hierarchical-cache); made 0700, and refused when another uid owns it or group or others may write it",
        },
    )
    hicache_storage_size: float = field(
        default=16.0,
        metadata={
            "group": "cache",
            "help": "GB the disk tier may use; least recently used blocks are removed",
        },
    )
    preemption_mode: str | None = field(
        default=None,
        metadata={
            "group": "cache",
            "help": "what a request retracted for lack of memory keeps: swap (its KV goes to the host tier and comes back) or recompute (default: swap with --enable-hierarchical-cache, else recompute)",
            "choices": ["recompute", "swap"],
        },
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "group": "cache",
            "help": 'publish every page the radix tree stores, evicts or clears as KV-cache events over ZeroMQ, in vLLM\'s schema: vLLM\'s KVEventsConfig JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv@pod@model"}\' (keys: publisher, buffer_steps, hwm, max_queue_size too; docs/kv_events.md)',
        },
    )
    max_queued_requests: int = field(
        default=4096,
        metadata={
            "group": "batching",
            "help": "waiting requests past which new ones get an 'overloaded' error",
        },
    )
    max_prompt_logprob_entries: int = field(
        default=1 << 22,
        metadata={
            "group": "batching",
            "help": "prompt logprob values one request may ask for: n x (1 + top_logprobs_num) x scored prompt tokens; past it, 'invalid_request' before it is queued",
        },
    )
    # ---- tenants, priorities, deadlines, drain, limits (docs/protocol.md, "Tenants") ----
    api_key_file: str | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "a file of 'tenant:key' or 'tenant:key:maxprio' lines: each key is accepted and names its tenant, whose requests share only that tenant's prefix cache and whose priority is capped at maxprio (read as a cap only when the text after the key's last colon is an integer); with --api-key too, that key is the default tenant's",
        },
    )
    schedule_low_priority_values_first: bool = field(
        default=False,
        metadata={
            "group": "priority",
            "help": "a request's lower `priority` value runs first (default: higher first)",
        },
    )
    enable_priority_preemption: bool = field(
        default=False,
        metadata={
            "group": "priority",
            "help": "retract running lower-priority requests when a higher-priority one cannot be admitted for lack of room",
        },
    )
    priority_aging_s: float = field(
        default=10.0,
        metadata={
            "group": "priority",
            "help": "a waiting request gains one priority level per this many seconds, so a low-priority request outranks any higher one that arrives (gap x this) seconds after it",
        },
    )
    drain_timeout: float = field(
        default=30.0,
        metadata={
            "group": "server",
            "help": "on SIGTERM: refuse new requests ('draining'), let queued and running ones finish for at most this many seconds, abort the rest, exit 0",
        },
    )
    max_inflight_per_tenant: int | None = field(
        default=None,
        metadata={
            "group": "tenants",
            "help": "requests one tenant (its API key; without a key file, one client connection) may have queued or running; past it, 'rate_limited' (default: with --api-key-file, a quarter of --max-queued-requests; else no limit)",
        },
    )
    max_pinned_tokens_per_client: int | None = field(
        default=None,
        metadata={
            "group": "tenants",
            "help": "cached prefix tokens one tenant (its API key; without a key file, one client connection) may hold pinned (a fork's shared prefix) at once; past it, a pin gets 'rate_limited' (default: half the KV pool)",
        },
    )
    max_pins_per_tenant: int = field(
        default=256,
        metadata={
            "group": "tenants",
            "help": "pins one tenant (its API key; without a key file, one client connection) may hold at once; past it, a pin gets 'rate_limited'",
        },
    )
    max_queued_tokens_per_tenant: int | None = field(
        default=None,
        metadata={
            "group": "tenants",
            "help": "prompt tokens one tenant may have waiting for admission; past it, 'rate_limited' (default: with --api-key-file, four times the KV pool; else no limit)",
        },
    )
    tenant_max_priority: int = field(
        default=0,
        metadata={
            "group": "tenants",
            "help": "the most urgent priority a request sent with a key other than the admin's may have when the key's line sets no maxprio: a more urgent one is clamped to it (the admin's and a keyless server's requests are not capped)",
        },
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "group": "structured",
            "help": "how models write tool calls on /v1/chat/completions, and how they are read and constrained: hermes (<tool_call>{...}</tool_call>), llama3-json, mistral, pythonic, or auto (the chat template's format, else hermes)",
            "choices": ["auto", "hermes", "llama3-json", "mistral", "pythonic"],
        },
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "group": "structured",
            "help": "split a reasoning model's <think>...</think> from the answer into message.reasoning_content (streamed: delta.reasoning_content) on /v1/chat/completions: deepseek-r1 (the reply starts inside the block: the template opened it) or qwen3 (only a reply that starts with <think>); off when unset",
            "choices": list(REASONING_PARSER_NAMES),
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "required in every message when set; needed to bind a non-loopback host",
        },
    )
    curve_secret_key: str | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "Z85 CURVE secret key: encrypt and authenticate the socket (clients need the public key); or set RADIXRT_CURVE_SECRET_KEY",
        },
    )
    admin_api_key: str | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "the key of control ops (shutdown, flush_cache, memory_snapshot, check_invariants) and of every tenant's stats; a tenant key gets 'unauthorized' (a lone --api-key without --api-key-file stays the admin); or set RADIXRT_ADMIN_API_KEY",
        },
    )
    curve_client_keys: str | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "a file of client CURVE public keys (Z85, one a line): only these may connect (checked through ZAP; needs --curve-secret-key)",
        },
    )
    max_frame_bytes: int = field(
        default=16 << 20,
        metadata={
            "group": "server",
            "help": "the largest frame a client may send: a longer one drops its connection (ZMQ_MAXMSGSIZE), and msgpack containers and strings are bounded before they are built",
        },
    )
    http_request_timeout: float = field(
        default=600.0,
        metadata={
            "group": "server",
            "help": "the HTTP gateway's bound on one request, in seconds: a request whose timeout is unset or longer gets this one (the runtime ends it with 'timeout'), and one the runtime has not answered a few seconds past it is answered 504 'timeout' by the gateway and aborted",
        },
    )
    http_pin_lease: float = field(
        default=600.0,
        metadata={
            "group": "server",
            "help": "seconds a pin made through the HTTP gateway (/pin) holds unless /unpin comes first; then the gateway unpins it (each caller's pins are its own and count under its key's tenant)",
        },
    )
    max_prompt_bytes: int = field(
        default=4 << 20,
        metadata={
            "group": "server",
            "help": "a generate whose text (UTF-8 bytes) or input_ids (4 bytes each) is larger gets 'invalid_request' before it is tokenized",
        },
    )
    random_seed: int = field(
        default=0,
        metadata={"group": "batching", "help": "seed of the sampler for requests that set none"},
    )
    log_interval: int = field(
        default=40,
        metadata={"group": "logging", "help": "decode steps between two throughput log lines"},
    )
    log_level: str = field(
        default="info", metadata={"group": "logging", "help": "debug, info, warning or error"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # choices, then every group's own rules
        # rules across two groups
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
        """What the model is called to clients: --served-model-name, else --model as given."""
        return self.served_model_name or self.model

    @property
    def executor(self) -> ExecutorArgs:
        return _part(ExecutorArgs, self)

    @property
    def scheduler(self) -> SchedulerArgs:
        return _part(SchedulerArgs, self)

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


def server_field(name: str, default: Any = dataclasses.MISSING, **metadata: Any) -> Any:
    """`ServerArgs`'s field `name` (default, group, help, choices) for another settings class
    that means the same by it (`RouterArgs`, the bench's `BenchConfig`): one flag name and help.
    `default` and `metadata` entries replace the server's where that class needs its own."""
    f = ServerArgs.__dataclass_fields__[name]
    default = f.default if default is dataclasses.MISSING else default
    return field(default=default, metadata={**f.metadata, **metadata})


@dataclass(frozen=True)
class RouterArgs(Settings):
    """The flags of `radixrt router`: one client-facing socket over several `radixrt serve`
    workers. What it shares with `serve` is `serve`'s own field (same flag, default, help)."""

    host: str = server_field("host")
    port: int = field(
        default=30001,
        metadata={
            "group": "server",
            "help": "the clients' ZeroMQ port (the router serves no HTTP)",
        },
    )
    worker: tuple[str, ...] = field(
        default=(),
        metadata={
            "group": "workers",
            "help": "a worker's address, e.g. tcp://10.0.0.2:30001 (its ZeroMQ port); at least one",
        },
    )
    worker_api_key: str | None = field(
        default=None,
        metadata={
            "group": "workers",
            "help": "what the router sends the workers (default: --admin-api-key, else --api-key, else the key file's first key)",
        },
    )
    worker_curve_server_key: str | None = field(
        default=None, metadata={"group": "workers", "help": "the workers' CURVE public key"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "group": "workers",
            "help": "the workers' tokenizer.json, when their model folder is not on this machine",
        },
    )
    # --policy: the name DESIGN.md gives `radixrt router`'s flag
    router_policy: str = server_field("router_policy", aliases=["--policy"])
    router_cache_threshold: float = server_field("router_cache_threshold")
    router_balance_abs_threshold: int = server_field("router_balance_abs_threshold")
    router_balance_rel_threshold: float = server_field("router_balance_rel_threshold")
    api_key_file: str | None = server_field("api_key_file")
    api_key: str | None = server_field("api_key")
    curve_secret_key: str | None = server_field("curve_secret_key")
    admin_api_key: str | None = server_field("admin_api_key")
    curve_client_keys: str | None = server_field("curve_client_keys")
    max_frame_bytes: int = server_field("max_frame_bytes")
    max_prompt_bytes: int = server_field("max_prompt_bytes")
    drain_timeout: float = server_field("drain_timeout")
    log_level: str = server_field("log_level")
    metrics_port: int | None = field(
        default=None,
        metadata={
            "group": "server",
            "help": "serve GET /metrics (Prometheus text: the workers' series, each labelled worker=, and the router's own) over HTTP on --host at this port; with keys configured it needs the admin key as a Bearer token",
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.worker:
            raise ValueError("a router needs at least one --worker")

    @property
    def endpoint(self) -> str:
        """ZeroMQ address the clients' socket binds."""
        return endpoint_of(self.host, self.port)
