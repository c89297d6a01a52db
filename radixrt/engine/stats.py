"""The scheduler's counters, the `stats()` map built from them, and the periodic step logs.

The keys of `scheduler_stats` are a contract: tests, the router (which adds workers' counters
up), the benchmark's floors and docs/protocol.md read them by name.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from radixrt.engine.request import Req, Scheduled
from radixrt.engine.speculation import SpecCounters
from radixrt.engine.tenant_stats import TenantStats
from radixrt.mem_cache.slot_manager import KVSlotManager, KVUsage
from radixrt.structured.compiler import CompileStats

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """What the scheduler counted since it started (all monotonic)."""

    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0  # prompt tokens not recomputed at first admission
    image_tokens_total: int = 0  # of the prompt tokens, images' placeholders
    cached_image_tokens_total: int = 0  # of the cached ones, images' placeholders
    host_hit_tokens: int = 0  # prompt tokens loaded back from the host tier at admission
    storage_hit_tokens: int = 0  # of which the disk tier had read into the host
    swapped_in_tokens: int = 0  # retracted requests' tokens loaded back at readmission
    num_preemptions: int = 0  # retractions for room
    priority_preemptions: int = 0  # retractions for a higher-priority waiting request
    timed_out_requests: int = 0
    aborted_requests: int = 0  # by their clients (an abort op or a client gone silent)
    failed_steps: int = 0  # steps that raised: their requests ended with internal_error
    generated_tokens: int = 0
    # what the forwards computed, for the benchmark's compute and bandwidth floors
    forward_steps: int = 0
    forward_tokens: int = 0
    attention_pairs: int = 0  # (query, key) pairs attended, over all requests and steps
    logit_rows: int = 0
    step_time: float = 0.0  # seconds in forward + sampling
    mask_time: float = 0.0  # of which, building and applying constraint masks

    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(self.prompt_tokens_total, 1)

    def count_forward(self, plan: list[Scheduled]) -> None:
        """A forward over `plan`: n new tokens after kv_len cached ones attend to kv_len + 1 ...
        kv_len + n keys."""
        self.forward_steps += bool(plan)
        self.forward_tokens += sum(s.n for s in plan)
        self.attention_pairs += sum(s.n * s.req.kv_len + s.n * (s.n + 1) // 2 for s in plan)


@dataclass(frozen=True)
class StatsInputs:
    """What `scheduler_stats` reads besides the counters, each from its owner."""

    usage: KVUsage
    waiting: list[Req]
    running: list[Req]
    tenants: TenantStats
    tp_size: int
    tp_collective_time: float
    compiles: CompileStats
    spec: SpecCounters
    max_loras: int  # adapters one batch may hold (`--max-loras-per-batch`)
    image_encoder_calls: int  # images the runner's vision encoder ran on (features cached)


def scheduler_stats(c: Counters, x: StatsInputs) -> dict[str, Any]:
    """The `stats` op's map (its keys are a contract, see the module docstring)."""
    u, spec = x.usage, x.spec
    return {
        "tp_size": x.tp_size,
        "tp_collective_time_s": x.tp_collective_time,  # rank 0's, in step_time_s
        "total_tokens": u.total_tokens,
        "free_tokens": u.free_tokens,
        "cached_tokens": u.evictable_tokens + u.protected_tokens,
        "evictable_tokens": u.evictable_tokens,
        "protected_tokens": u.protected_tokens,
        "running": len(x.running),
        "waiting": len(x.waiting),
        "cache_hit_rate": c.cache_hit_rate(),
        # the rate's two sides, so a router can add them up over its workers
        "prompt_tokens_total": c.prompt_tokens_total,
        "cached_prompt_tokens_total": c.cached_tokens_total,
        # of which images' placeholders, and the images encoded (once per content while cached)
        "image_tokens_total": c.image_tokens_total,
        "cached_image_tokens_total": c.cached_image_tokens_total,
        "image_encoder_calls": x.image_encoder_calls,
        "num_preemptions": c.num_preemptions,
        "priority_preemptions": c.priority_preemptions,
        "timed_out_requests": c.timed_out_requests,
        "cache_salts": u.cache_salts,
        "tenants": x.tenants.snapshot(x.waiting, x.running),
        "evicted_tokens": u.evicted_tokens,
        "free_request_rows": u.free_rows,
        "generated_tokens": c.generated_tokens,
        "aborted_requests": c.aborted_requests,
        "failed_steps": c.failed_steps,
        "peak_used_tokens": u.peak_used_tokens,
        "pins": u.pins,
        "step_time_s": c.step_time,
        "forward_steps": c.forward_steps,
        "forward_tokens": c.forward_tokens,
        "attention_pairs": c.attention_pairs,
        "logit_rows": c.logit_rows,
        "constraint_mask_time_s": c.mask_time,
        "constraint_compiles": dataclasses.asdict(x.compiles),
        "host_total_tokens": u.host_total_tokens,
        "host_used_tokens": u.host_used_tokens,
        "host_hit_tokens": c.host_hit_tokens,
        "storage_hit_tokens": c.storage_hit_tokens,
        "storage_rejected_blocks": u.storage_rejected_blocks,
        "swapped_out_tokens": u.swapped_out_tokens,
        "state_total_slots": u.state_total_slots,
        "state_free_slots": u.state_free_slots,
        "state_cached_slots": u.state_cached_slots,
        # the adapters requests run under (vLLM's `lora_requests_info`, which endpoint pickers read)
        "running_lora_adapters": sorted({r.scope.lora_path for r in x.running} - {""}),
        "waiting_lora_adapters": sorted({r.scope.lora_path for r in x.waiting} - {""}),
        "max_loras_per_batch": x.max_loras,
        "kv_event_batches": u.kv_event_batches,
        "kv_event_dropped_batches": u.kv_event_dropped_batches,
        "swapped_in_tokens": c.swapped_in_tokens,
        "spec_verifications": spec.verifications,
        "spec_draft_tokens": spec.draft_tokens,
        "spec_accepted_tokens": spec.accepted_tokens,
        # tokens a request gets from one forward that verifies its draft (1 = no gain)
        "spec_accept_length": 1 + spec.accepted_tokens / max(spec.verifications, 1),
    }


class StepLog:
    """The info lines: one per prefill step, one every `interval` decode steps."""

    def __init__(self, counters: Counters, kv: KVSlotManager, interval: int):
        self.counters = counters
        self.kv = kv  # for the token usage, read only when a line is written
        self.interval = interval
        self._decode_steps = 0
        self._mark = (time.monotonic(), 0)  # (when, generated tokens then)

    def prefill(self, admitted: list[Scheduled], running: int, waiting: int) -> None:
        logger.info(
            "prefill: %d new reqs, %d new tokens, %d cached tokens | running %d, queue %d, "
            "token usage %.2f, cache hit rate %.2f",
            len(admitted),
            sum(s.n for s in admitted),
            sum(s.req.tree_len for s in admitted),
            running,
            waiting,
            self.kv.usage().used_fraction,
            self.counters.cache_hit_rate(),
        )

    def decode(self, running: int, waiting: int) -> None:
        self._decode_steps += 1
        if self._decode_steps % self.interval:
            return
        now = time.monotonic()
        then, tokens = self._mark
        generated = self.counters.generated_tokens
        self._mark = (now, generated)
        logger.info(
            "decode: running %d, queue %d, token usage %.2f, cache hit rate %.2f, gen throughput %.1f tok/s",
            running,
            waiting,
            self.kv.usage().used_fraction,
            self.counters.cache_hit_rate(),
            (generated - tokens) / max(now - then, 1e-9),
        )
