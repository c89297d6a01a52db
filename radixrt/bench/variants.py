"""The systems `radixrt bench` compares: radixrt variants (server settings over the bench's) and
peers (other runtimes), and which of them each workload compares by default. Data only: the
config checks `--systems` against it, `systems.py` runs it."""

from __future__ import annotations

from typing import Any

from radixrt.bench.programs import PROGRAM_WORKLOADS

# radixrt configurations compared with each other: name -> server arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "radixrt": {},
    "radixrt-no-cache": {"disable_radix_cache": True},
    "radixrt-static": {"schedule_mode": "static"},
    "radixrt-no-chunking": {"chunked_prefill_size": 0},
    "radixrt-no-jump-forward": {"enable_jump_forward": False},
    "radixrt-llguidance": {"grammar_backend": "llguidance"},
    "radixrt-llguidance-no-jump-forward": {
        "grammar_backend": "llguidance",
        "enable_jump_forward": False,
    },
    "radixrt-int8": {"quantization": "int8"},
    "radixrt-int4": {"quantization": "int4"},
    "radixrt-gguf": {"quantization": "gguf"},
    "radixrt-spec": {"speculative_algorithm": "ngram"},
    # bitwise-reproducible serving, against the fast path of the same weights
    "radixrt-deterministic": {"enable_deterministic_inference": True},
    "radixrt-int8-deterministic": {"quantization": "int8", "enable_deterministic_inference": True},
    "radixrt-int4-deterministic": {"quantization": "int4", "enable_deterministic_inference": True},
    "radixrt-no-jump-forward-spec": {
        "enable_jump_forward": False,
        "speculative_algorithm": "ngram",
    },
    # the host tier (swap preemption on), under each write policy; and with recompute preemption
    "radixrt-hicache": {"enable_hierarchical_cache": True},
    "radixrt-hicache-write-through": {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
    },
    "radixrt-hicache-write-back": {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_back",
    },
    "radixrt-tp2": {"tp_size": 2},  # two rank processes, a thread each on a 2-core CPU
    # two workers behind the router, a thread each on a 2-core CPU, half the pool each
    "radixrt-dp2": {"dp_size": 2},
    "radixrt-dp2-round-robin": {"dp_size": 2, "router_policy": "round-robin"},
    "radixrt-dp2-shortest-queue": {"dp_size": 2, "router_policy": "shortest-queue"},
    "radixrt-hicache-recompute": {
        "enable_hierarchical_cache": True,
        "preemption_mode": "recompute",
    },
}
LLAMA_PEERS = ("llama.cpp", "llama-server")
PEERS = ("transformers", *LLAMA_PEERS)
DEFAULT_SYSTEMS = {
    "shared-prefix": "radixrt,radixrt-no-cache,radixrt-static,radixrt-int8,transformers,"
    "llama.cpp,llama-server",
    "multi-turn": "radixrt,radixrt-no-cache,llama.cpp,llama-server",
    # ratios over round-robin, the policy cache-aware routing is measured against
    "multi-prefix": "radixrt-dp2,radixrt-dp2-round-robin,radixrt-dp2-shortest-queue,radixrt",
    "long-prompt": "radixrt,radixrt-no-chunking",
    "random": "radixrt,radixrt-no-cache,transformers",
    "sharegpt": "radixrt,radixrt-no-cache",
    "json": "radixrt,radixrt-no-jump-forward,radixrt-llguidance,radixrt-llguidance-no-jump-forward,"
    "radixrt-spec",
    "agent-loop": "radixrt,radixrt-spec",
    "few-shot": "radixrt,radixrt-spec",
    **{w: "radixrt,radixrt-no-cache" for w in PROGRAM_WORKLOADS},
    # one variant after another (`radixrt-dp2`: a fleet behind the router)
    "flood-latency": "radixrt",
    "weight-update-time": "radixrt",
}
