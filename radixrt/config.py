"""Server settings: one dataclass shared by the CLI, `rt.Engine` and `rt.Runtime`.

`ServerArgs` is what users set (flags, keywords); it is frozen, so nothing changes it after launch
(launchers make a new one with `dataclasses.replace`). Each component receives only its part:
`ExecutorArgs` (the model and its pools), `SchedulerArgs` (batching and caching); the server
keeps the rest (addresses, keys, queue limits).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

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
    disable_cuda_graph: bool
    max_total_tokens: int | None
    mem_fraction: float | None
    page_size: int
    context_length: int | None
    max_running_requests: int  # sizes the request->token table
    tp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None


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
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: float | None
    hicache_write_policy: str
    hicache_storage_dir: str | None
    hicache_storage_size: float
    preemption_mode: str | None
    random_seed: int
    log_interval: int
    schedule_low_priority_values_first: bool
    enable_priority_preemption: bool
    priority_aging_s: float
    max_pinned_tokens_per_client: int | None


# the cache-aware router's defaults (radixrt/server/router/policy.py says why these values)
ROUTER_CACHE_THRESHOLD = 0.5
ROUTER_BALANCE_ABS_THRESHOLD = 4
ROUTER_BALANCE_REL_THRESHOLD = 1.25
MIN_FRAME_BYTES = 4096  # a smaller frame limit would refuse ordinary requests


def is_loopback_host(host: str) -> bool:
    """An ipc:// path or a loopback address: reachable from this machine only."""
    return host.startswith("ipc://") or host in ("127.0.0.1", "localhost", "::1")


def _part(cls: type, args: ServerArgs) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ServerArgs:
    model: str = field(
        default="default",
        metadata={
            "help": "'default' (SmolLM2-135M-Instruct), a Hugging Face model folder, a .gguf file, or a Hugging Face Hub id already in the local Hub cache (needs huggingface_hub; nothing is downloaded)"
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model's name in the OpenAI API (/v1/models, each response's `model`) and in model_info (default: --model as given)"
        },
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata={
            "help": "the tokenizer's folder or Hugging Face Hub id, when it is not the model's (default: --model)"
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "the chat template to use instead of the tokenizer's: a file holding a Jinja template, or the template itself"
        },
    )
    host: str = field(
        default="127.0.0.1", metadata={"help": "address to bind; loopback unless told otherwise"}
    )
    port: int = field(default=30000, metadata={"help": "TCP port of the ZeroMQ ROUTER socket"})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto (triton on CUDA, torch on CPU), torch or triton",
            "choices": ["auto", "torch", "triton"],
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16",
            "choices": ["auto", "float32", "bfloat16"],
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "int8: weight-only int8 linears (CPU with AVX2; opt-in, quality-gated, not token-exact)",
            "choices": ["int8"],
        },
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata={
            "help": "on CUDA, launch every decode step's kernels instead of replaying graphs"
        },
    )
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV slots in the token pool; overrides --mem-fraction"}
    )
    mem_fraction: float | None = field(
        default=None,
        metadata={
            "help": "fraction of free memory given to the KV pool when --max-total-tokens is not set (default: 0.8 on CUDA, 0.1 on CPU)"
        },
    )
    page_size: int = field(
        default=1, metadata={"help": "tokens per KV page; the radix tree matches whole pages"}
    )
    context_length: int | None = field(
        default=None,
        metadata={"help": "max prompt+output tokens per request (default: the model's)"},
    )
    tp_size: int = field(
        default=1,
        metadata={
            "help": "tensor parallelism: shard the model's heads, MLP and vocabulary over this many rank processes (one GPU each on CUDA, cores/N threads each on the CPU), gloo on the CPU, NCCL on CUDA"
        },
    )
    nnodes: int = field(
        default=1, metadata={"help": "machines the --tp-size ranks are spread over"}
    )
    node_rank: int = field(
        default=0,
        metadata={
            "help": "this machine's index among --nnodes: 0 runs the scheduler and the socket, the others only host ranks"
        },
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata={
            "help": "HOST:PORT where the ranks meet (torch.distributed TCP rendezvous; needed with --nnodes > 1; default: a free loopback port)"
        },
    )
    dp_size: int = field(
        default=1,
        metadata={
            "help": "data parallelism: this many workers (a share of the cores each on the CPU, their own GPUs on CUDA) behind a router on --host/--port"
        },
    )
    router_policy: str = field(
        default="cache-aware",
        metadata={
            "help": "with --dp-size: cache-aware (the worker whose cache holds the longest prefix, unless load is out of balance), round-robin or shortest-queue",
            "choices": ["cache-aware", "round-robin", "shortest-queue"],
        },
    )
    router_cache_threshold: float = field(
        default=ROUTER_CACHE_THRESHOLD,
        metadata={
            "help": "cache-aware: route by match only when it covers at least this share of the prompt"
        },
    )
    router_balance_abs_threshold: int = field(
        default=ROUTER_BALANCE_ABS_THRESHOLD,
        metadata={
            "help": "cache-aware: load is out of balance when the busiest worker has this many more sequences than the idlest..."
        },
    )
    router_balance_rel_threshold: float = field(
        default=ROUTER_BALANCE_REL_THRESHOLD,
        metadata={"help": "...and more than this many times as many; then the idlest gets it"},
    )
    schedule_policy: str = field(
        default="lpm",
        metadata={
            "help": "lpm (longest prefix match), fcfs or dfs-weight",
            "choices": ["lpm", "fcfs", "dfs-weight"],
        },
    )
    schedule_mode: str = field(
        default="continuous",
        metadata={
            "help": "continuous (requests join and leave at every step) or static (a new batch is admitted only once the previous one has fully finished: the baseline continuous batching is measured against)",
            "choices": ["continuous", "static"],
        },
    )
    chunked_prefill_size: int = field(
        default=2048,
        metadata={
            "help": "max prompt tokens per step (of one request and of all together); longer prompts are prefilled in chunks, so decodes are never stalled behind a long prefill (<=0 disables chunking)"
        },
    )
    max_prefill_tokens: int = field(
        default=8192, metadata={"help": "max new prompt tokens admitted per step over all requests"}
    )
    max_running_requests: int = field(
        default=256, metadata={"help": "max requests decoding at once"}
    )
    disable_radix_cache: bool = field(
        default=False, metadata={"help": "turn prefix matching off (same code path, no reuse)"}
    )
    enable_jump_forward: bool = field(
        default=True,
        metadata={
            "help": "append text a constraint forces (JSON keys and punctuation) in one extend instead of decoding it token by token; --no-enable-jump-forward decodes every token"
        },
    )
    constraint_compile_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds a regex or JSON-schema constraint may take to compile; its worker process is then killed and the request ends with 'invalid_constraint' (too complex), a verdict kept for retries"
        },
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata={
            "help": "ngram: each decoding request drafts the tokens that followed its last few tokens in finished requests or in its own prompt and output, and one forward verifies them (greedy output unchanged; off by default)",
            "choices": ["ngram"],
        },
    )
    speculative_num_draft_tokens: int = field(
        default=8,
        metadata={
            "help": "most tokens drafted per request and step with --speculative-algorithm; below it a request drafts only the tokens whose chance of acceptance pays for their row at the current batch size"
        },
    )
    enable_hierarchical_cache: bool = field(
        default=False,
        metadata={
            "help": "keep prefixes evicted from the KV pool in host memory and load them back instead of recomputing them"
        },
    )
    hicache_ratio: float = field(
        default=2.0,
        metadata={"help": "host tier size as a multiple of the KV pool (unless --hicache-size)"},
    )
    hicache_size: float | None = field(
        default=None, metadata={"help": "host tier size in GB of KV; overrides --hicache-ratio"}
    )
    hicache_write_policy: str = field(
        default="write_through_selective",
        metadata={
            "help": "when a cached prefix is copied to the host: write_through (when cached), write_through_selective (from its second use, and when evicted while the host has free room) or write_back (when evicted from the pool)",
            "choices": ["write_through", "write_through_selective", "write_back"],
        },
    )
    hicache_storage_dir: str | None = field(
        default=None,
        metadata={
            "help": "a disk tier under the host tier: finished requests' KV blocks are written here as safetensors files and read back on a miss, across restarts (needs --enable-hierarchical-cache); made 0700, and refused when another uid owns it or group or others may write it"
        },
    )
    hicache_storage_size: float = field(
        default=16.0,
        metadata={"help": "GB the disk tier may use; least recently used blocks are removed"},
    )
    preemption_mode: str | None = field(
        default=None,
        metadata={
            "help": "what a request retracted for lack of memory keeps: swap (its KV goes to the host tier and comes back) or recompute (default: swap with --enable-hierarchical-cache, else recompute)",
            "choices": ["recompute", "swap"],
        },
    )
    max_queued_requests: int = field(
        default=4096,
        metadata={"help": "waiting requests past which new ones get an 'overloaded' error"},
    )
    # ---- tenants, priorities, deadlines, drain, limits (docs/protocol.md, "Tenants") ----
    api_key_file: str | None = field(
        default=None,
        metadata={
            "help": "a file of 'tenant:key' or 'tenant:key:maxprio' lines: each key is accepted and names its tenant, whose requests share only that tenant's prefix cache and whose priority is capped at maxprio (read as a cap only when the text after the key's last colon is an integer); with --api-key too, that key is the default tenant's"
        },
    )
    schedule_low_priority_values_first: bool = field(
        default=False,
        metadata={"help": "a request's lower `priority` value runs first (default: higher first)"},
    )
    enable_priority_preemption: bool = field(
        default=False,
        metadata={
            "help": "retract running lower-priority requests when a higher-priority one cannot be admitted for lack of room"
        },
    )
    priority_aging_s: float = field(
        default=10.0,
        metadata={
            "help": "a waiting request gains one priority level per this many seconds, so a low-priority request outranks any higher one that arrives (gap x this) seconds after it"
        },
    )
    drain_timeout: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM: refuse new requests ('draining'), let queued and running ones finish for at most this many seconds, abort the rest, exit 0"
        },
    )
    max_inflight_per_tenant: int | None = field(
        default=None,
        metadata={
            "help": "requests one tenant (its API key; without a key file, one client connection) may have queued or running; past it, 'rate_limited'"
        },
    )
    max_pinned_tokens_per_client: int | None = field(
        default=None,
        metadata={
            "help": "cached prefix tokens one client connection may hold pinned (a fork's shared prefix) at once; past it, a pin gets 'rate_limited' (default: half the KV pool)"
        },
    )
    max_queued_tokens_per_tenant: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens one tenant may have waiting for admission; past it, 'rate_limited'"
        },
    )
    http_port: int | None = field(
        default=None,
        metadata={
            "help": "also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /metrics, ...) on this port of --host (off when unset)"
        },
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": "how models write tool calls on /v1/chat/completions, and how they are read and constrained: hermes (<tool_call>{...}</tool_call>), llama3-json, mistral, pythonic, or auto (the chat template's format, else hermes)",
            "choices": ["auto", "hermes", "llama3-json", "mistral", "pythonic"],
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={"help": "required in every message when set; needed to bind a non-loopback host"},
    )
    curve_secret_key: str | None = field(
        default=None,
        metadata={
            "help": "Z85 CURVE secret key: encrypt and authenticate the socket (clients need the public key); or set RADIXRT_CURVE_SECRET_KEY"
        },
    )
    admin_api_key: str | None = field(
        default=None,
        metadata={
            "help": "the key of control ops (shutdown, flush_cache, memory_snapshot, check_invariants) and of every tenant's stats; a tenant key gets 'unauthorized' (a lone --api-key without --api-key-file stays the admin); or set RADIXRT_ADMIN_API_KEY"
        },
    )
    curve_client_keys: str | None = field(
        default=None,
        metadata={
            "help": "a file of client CURVE public keys (Z85, one a line): only these may connect (checked through ZAP; needs --curve-secret-key)"
        },
    )
    max_frame_bytes: int = field(
        default=16 << 20,
        metadata={
            "help": "the largest frame a client may send: a longer one drops its connection (ZMQ_MAXMSGSIZE), and msgpack containers and strings are bounded before they are built"
        },
    )
    max_prompt_bytes: int = field(
        default=4 << 20,
        metadata={
            "help": "a generate whose text (UTF-8 bytes) or input_ids (4 bytes each) is larger gets 'invalid_request' before it is tokenized"
        },
    )
    random_seed: int = field(
        default=0, metadata={"help": "seed of the sampler for requests that set none"}
    )
    log_interval: int = field(
        default=40, metadata={"help": "decode steps between two throughput log lines"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', not {self.quantization!r}")
        if self.speculative_algorithm not in (None, "ngram"):
            raise ValueError(
                f"speculative_algorithm must be None or 'ngram', not {self.speculative_algorithm!r}"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        if self.tp_size < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("tp_size and nnodes must be >= 1, node_rank in [0, nnodes)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} does not split over {self.nnodes} nodes")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0)")
        if self.dp_size < 1 or (self.dp_size > 1 and self.nnodes > 1):
            raise ValueError("dp_size must be >= 1, and 1 with nnodes > 1 (use `radixrt router`)")
        if self.tp_size > 1 and self.enable_hierarchical_cache:
            raise ValueError("the host tier does not run with tp_size > 1 yet")
        if self.hicache_ratio <= 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("hicache_ratio and hicache_size must be > 0")
        if self.hicache_write_policy not in (
            "write_through",
            "write_through_selective",
            "write_back",
        ):
            raise ValueError(f"unknown hicache_write_policy {self.hicache_write_policy!r}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', not {self.preemption_mode!r}"
            )
        if not self.enable_hierarchical_cache and (
            self.hicache_storage_dir is not None or self.preemption_mode == "swap"
        ):
            raise ValueError(
                "hicache_storage_dir and preemption_mode='swap' need enable_hierarchical_cache"
            )
        if self.curve_client_keys and self.http_port:
            raise ValueError(
                "curve_client_keys does not run with http_port yet: the gateway's link is not on the list"
            )
        if self.max_frame_bytes < MIN_FRAME_BYTES or self.max_prompt_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= {MIN_FRAME_BYTES}, max_prompt_bytes >= 1")
        if self.priority_aging_s <= 0 or self.drain_timeout < 0:
            raise ValueError("priority_aging_s must be > 0 and drain_timeout >= 0")
        if any(
            v is not None and v < 1
            for v in (
                self.max_inflight_per_tenant,
                self.max_queued_tokens_per_tenant,
                self.max_pinned_tokens_per_client,
            )
        ):
            raise ValueError(
                "max_inflight_per_tenant, max_queued_tokens_per_tenant and max_pinned_tokens_per_client must be >= 1"
            )
        if not self.constraint_compile_timeout > 0:
            raise ValueError("constraint_compile_timeout must be > 0 seconds")
        if self.hicache_storage_size <= 0:
            raise ValueError("hicache_storage_size must be > 0")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be >= 1")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError("mem_fraction must be in (0, 1)")
        if (
            self.max_running_requests < 1
            or self.max_prefill_tokens < 1
            or self.max_queued_requests < 1
        ):
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            helptext = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext
                )
                continue
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
                str(f.type), str
            )
            parser.add_argument(
                flag,
                type=kind,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=f"{helptext} (default: {f.default})",
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

    def with_secrets_from_env(self) -> ServerArgs:
        """These settings with unset secrets taken from their environment variables."""
        return dataclasses.replace(
            self,
            **{
                name: getattr(self, name) or os.environ.get(var) or None
                for name, var in SECRETS.items()
            },
        )

    @property
    def endpoint(self) -> str:
        """ZeroMQ address to bind: `--host` may itself be an ipc:// path."""
        return self.host if self.host.startswith("ipc://") else f"tcp://{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def http_host(self) -> str:
        """Where `--http-port` listens: `--host`, or loopback when that is an ipc:// path."""
        return "127.0.0.1" if self.host.startswith("ipc://") else self.host

    def to_cli_args(self) -> list[str]:
        """The flags that recreate these settings on a `radixrt serve` command line."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in SECRETS:  # secrets travel by environment
                continue
            flag = f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                argv.append(f"--{flag}={value}")  # one argument, even for a value like "-1"
        return argv

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown server arguments: {sorted(unknown)}")
        return cls(**kwargs)
