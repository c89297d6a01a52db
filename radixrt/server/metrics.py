"""Prometheus metrics, every series labelled `model_name` (SGLang's and vLLM's dashboards group by it).

- `RuntimeMetrics` lives in the runtime process: it observes every request whatever its transport
  (HTTP through the gateway, ZeroMQ, the DSL), and renders its histograms together with the
  scheduler's `stats` read at scrape time. The `metrics` op returns that text.
- `GatewayMetrics` counts the HTTP gateway's own requests by route and status; the gateway's
  `/metrics` is its text followed by the runtime's.
- `merge_worker_metrics` is the router's `metrics` op: each worker's text with a `worker` label,
  and the router's own counters.

Names keep the `radixrt_` prefix and follow the semantics and units of SGLang's and vLLM's core set
(docs/metrics.md maps each to its counterparts).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from radixrt.protocol import tenant_label
from radixrt.server.tenants import TENANT_VISIBLE_STATS, Principal

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `*_created` series: a scraper reads rates from the counters

MODEL = "model_name"

# seconds; the first buckets are fine enough for a CPU decode step of a small model
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip


@dataclass(frozen=True)
class StatMetric:
    """One `stats` key as a metric: its name, help and kind (`gauge` or `counter`)."""

    name: str
    help: str
    kind: str = "gauge"

    def family(self, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
        kind = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        return kind(self.name, self.help, labels=labels)


# stats key -> metric; counters get `_total` in the exposition
RUNTIME_STATS = {
    "running": StatMetric("radixrt_num_requests_running", "requests in the running batch"),
    "waiting": StatMetric("radixrt_num_requests_waiting", "requests in the waiting queue"),
    "cache_hit_rate": StatMetric(
        "radixrt_cache_hit_rate", "cached prompt tokens / all prompt tokens since start"
    ),
    "prompt_tokens_total": StatMetric(
        "radixrt_prompt_tokens", "prompt tokens of admitted requests", "counter"
    ),
    "cached_prompt_tokens_total": StatMetric(
        "radixrt_cached_prompt_tokens",
        "prompt tokens not recomputed (radix cache, host or disk tier)",
        "counter",
    ),
    "generated_tokens": StatMetric("radixrt_generation_tokens", "generated tokens", "counter"),
    "total_tokens": StatMetric("radixrt_kv_tokens", "KV slots in the token pool"),
    "free_tokens": StatMetric("radixrt_kv_free_tokens", "free KV slots"),
    "cached_tokens": StatMetric("radixrt_kv_cached_tokens", "KV slots held by the radix tree"),
    "num_preemptions": StatMetric(
        "radixrt_preemptions", "requests retracted to free memory", "counter"
    ),
    "evicted_tokens": StatMetric(
        "radixrt_evicted_tokens", "tokens evicted from the radix tree", "counter"
    ),
    "host_total_tokens": StatMetric("radixrt_host_kv_tokens", "KV slots in the host tier"),
    "host_used_tokens": StatMetric("radixrt_host_kv_used_tokens", "host-tier KV slots in use"),
    "host_hit_tokens": StatMetric(
        "radixrt_host_hit_tokens",
        "prompt tokens loaded back from the host tier instead of recomputed",
        "counter",
    ),
    "storage_hit_tokens": StatMetric(
        "radixrt_storage_hit_tokens",
        "prompt tokens read from the disk tier instead of recomputed",
        "counter",
    ),
    "swapped_out_tokens": StatMetric(
        "radixrt_swapped_out_tokens",
        "tokens of retracted requests kept on the host tier",
        "counter",
    ),
    "swapped_in_tokens": StatMetric(
        "radixrt_swapped_in_tokens",
        "tokens of retracted requests loaded back at readmission",
        "counter",
    ),
    "state_total_slots": StatMetric(
        "radixrt_state_slots", "a recurrent model's state slots (--max-mamba-cache-size)"
    ),
    "state_free_slots": StatMetric("radixrt_state_free_slots", "free state slots"),
    "state_cached_slots": StatMetric(
        "radixrt_state_cached_slots", "state slots held by the radix tree as snapshots"
    ),
    "kv_event_batches": StatMetric(
        "radixrt_kv_event_batches", "KV-cache event batches published", "counter"
    ),
    "kv_event_dropped_batches": StatMetric(
        "radixrt_kv_event_dropped_batches",
        "KV-cache event batches dropped because the publisher's queue was full",
        "counter",
    ),
    "spec_draft_tokens": StatMetric(
        "radixrt_spec_draft_tokens", "speculative draft tokens proposed", "counter"
    ),
    "spec_accepted_tokens": StatMetric(
        "radixrt_spec_accepted_tokens", "speculative draft tokens the model agreed with", "counter"
    ),
    "spec_accept_length": StatMetric(
        "radixrt_spec_accept_length",
        "mean tokens a request got from one forward verifying its draft (1 = no gain)",
    ),
}

KV_USAGE = StatMetric(
    "radixrt_kv_usage_ratio",
    "KV slots held by requests, 0 to 1 (slots only the radix tree holds can be evicted: not counted)",
)

# stats()["tenants"][name] key -> metric, labelled by tenant
TENANT_STATS = {
    "requests": StatMetric("radixrt_tenant_requests", "requests a tenant got queued", "counter"),
    "prompt_tokens": StatMetric(
        "radixrt_tenant_prompt_tokens", "a tenant's admitted prompt tokens", "counter"
    ),
    "cached_prompt_tokens": StatMetric(
        "radixrt_tenant_cached_prompt_tokens",
        "a tenant's prompt tokens served from its own cache",
        "counter",
    ),
    "timeouts": StatMetric(
        "radixrt_tenant_timeouts", "a tenant's requests ended by their timeout", "counter"
    ),
    "rate_limited": StatMetric(
        "radixrt_tenant_rate_limited", "a tenant's refused requests", "counter"
    ),
    "running": StatMetric("radixrt_tenant_requests_running", "a tenant's running requests"),
    "waiting": StatMetric("radixrt_tenant_requests_waiting", "a tenant's waiting requests"),
}


# vLLM's names for what endpoint pickers read (the Gateway API Inference Extension's defaults,
# llm-d's scorers), each the radixrt series beside it: stats key -> (name, help)
VLLM_ALIASES = {
    "waiting": ("vllm:num_requests_waiting", "= radixrt_num_requests_waiting"),
    "running": ("vllm:num_requests_running", "= radixrt_num_requests_running"),
}
VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # now, before v0.10
VLLM_LORA_INFO = "vllm:lora_requests_info"


# the families a tenant's view holds (`RuntimeMetrics.render`, `merge_worker_metrics`): the stats
# it may see and its own tenant rows
TENANT_FAMILIES = frozenset(
    {m.name for key, m in RUNTIME_STATS.items() if key in TENANT_VISIBLE_STATS}
    | {m.name for m in TENANT_STATS.values()}
    | {name for key, (name, _) in VLLM_ALIASES.items() if key in TENANT_VISIBLE_STATS}
)


def kv_usage_ratio(stats: dict[str, Any]) -> float:
    """Slots neither free nor evictable over all slots (SGLang's `token_usage`, vLLM's
    `kv_cache_usage_perc`: both count a cached block nobody uses as free)."""
    used = stats["total_tokens"] - stats["free_tokens"] - stats["evictable_tokens"]
    return float(used / max(stats["total_tokens"], 1))


class _StatsCollector:
    """The scheduler's `stats` as metrics; `stats` is set just before each render."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        for key, metric in RUNTIME_STATS.items():
            if key in self.stats:
                family = metric.family([MODEL])
                family.add_metric([self.model_name], float(self.stats[key]))
                yield family
        if {"total_tokens", "free_tokens", "evictable_tokens"} <= self.stats.keys():
            family = KV_USAGE.family([MODEL])
            family.add_metric([self.model_name], kv_usage_ratio(self.stats))
            yield family
        yield from self._vllm_aliases()
        tenants = self.stats.get("tenants", {})
        for key, metric in TENANT_STATS.items():
            family = metric.family([MODEL, "tenant"])
            for tenant, counters in tenants.items():
                family.add_metric([self.model_name, tenant], float(counters[key]))
            yield family

    def _vllm_aliases(self) -> Iterator[Metric]:
        """The series an endpoint picker reads under vLLM's names (docs/deploy.md)."""
        for key, (name, helptext) in VLLM_ALIASES.items():
            if key in self.stats:
                family = GaugeMetricFamily(name, helptext, labels=[MODEL])
                family.add_metric([self.model_name], float(self.stats[key]))
                yield family
        if {"total_tokens", "free_tokens", "evictable_tokens"} <= self.stats.keys():
            for name in VLLM_KV_USAGE:
                family = GaugeMetricFamily(name, "= radixrt_kv_usage_ratio", labels=[MODEL])
                family.add_metric([self.model_name], kv_usage_ratio(self.stats))
                yield family
        if "running_lora_adapters" in self.stats:
            # vLLM's: one sample whose labels list the adapters, its value the time it was taken
            labels = [MODEL, "max_lora", "running_lora_adapters", "waiting_lora_adapters"]
            family = GaugeMetricFamily(VLLM_LORA_INFO, "adapters in use", labels=labels)
            family.add_metric(
                [
                    self.model_name,
                    str(self.stats["max_loras_per_batch"]),
                    ",".join(self.stats["running_lora_adapters"]),
                    ",".join(self.stats["waiting_lora_adapters"]),
                ],
                time.time(),
            )
            yield family


class RuntimeMetrics:
    """The runtime's request metrics, observed by the server loop (see zmq_server.Server):
    per request its TTFT, queue time, end-to-end latency and finish reason or error code, and each
    gap between two steps that gave it tokens (one ITL sample per gap, not a mean per request)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, helptext: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, helptext, [MODEL], buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "radixrt_time_to_first_token_seconds", "arrival to first output token", TTFT_BUCKETS
        ).labels(model_name)
        self.itl = histogram(
            "radixrt_inter_token_latency_seconds",
            "time between two steps that gave one request output tokens, each gap once",
            ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "radixrt_e2e_request_latency_seconds", "arrival to the last token", REQUEST_BUCKETS
        ).labels(model_name)
        self.queue_time = histogram(
            "radixrt_queue_time_seconds", "arrival to first admission to a batch", REQUEST_BUCKETS
        ).labels(model_name)
        self.finished = Counter(
            "radixrt_request_success",
            "requests finished with a result, by finish reason (stop, length, abort)",
            [MODEL, "finished_reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "radixrt_request_errors",
            "requests ended with an error or refused, by error code",
            [MODEL, "code"],
            registry=self.registry,
        )
        self.stats = _StatsCollector(model_name)
        self.registry.register(self.stats)
        # a tenant's view: the stats it may see, none of the histograms and counters that
        # every tenant's requests move (their timings would tell one tenant of another's load)
        self.tenant_registry = CollectorRegistry()
        self.tenant_registry.register(self.stats)

    def finish(self, reason: str) -> None:
        self.finished.labels(self.model_name, reason).inc()

    def error(self, code: str) -> None:
        self.errors.labels(self.model_name, code).inc()

    def render(self, stats: dict[str, Any], *, admin: bool) -> str:
        """The Prometheus text of `stats` (as the caller may see them) and, for the admin only,
        the request histograms and counters of every tenant's traffic."""
        self.stats.stats = stats
        return generate_latest(self.registry if admin else self.tenant_registry).decode()


class _HttpRequests:
    """The gateway's requests by route and status; the model's name is known at scrape time."""

    def __init__(self) -> None:
        self.counts: Tally[tuple[str, str]] = Tally()
        self.model_name = ""
        self.gauges = GatewayGauges(0, 0)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "radixrt_http_requests", "HTTP requests by endpoint and status code",
            labels=[MODEL, "endpoint", "code"],
        )  # fmt: skip
        for (endpoint, code), n in sorted(self.counts.items()):
            family.add_metric([self.model_name, endpoint, code], n)
        yield family
        for name, help_text, value in (
            ("radixrt_http_in_flight", "requests and calls awaiting the runtime's reply",
             self.gauges.in_flight),
            ("radixrt_http_pin_leases", "pins held for HTTP callers (each until its lease ends)",
             self.gauges.pin_leases),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, help_text, labels=[MODEL])
            gauge.add_metric([self.model_name], value)
            yield gauge


@dataclass(frozen=True)
class GatewayGauges:
    """What the gateway holds at scrape time: requests and calls awaiting the runtime's reply,
    and pins held for HTTP callers."""

    in_flight: int
    pin_leases: int


class GatewayMetrics:
    """The HTTP gateway's own series; `/metrics` puts the runtime's text after them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = _HttpRequests()
        self.registry.register(self.http)

    def count(self, endpoint: str, code: int) -> None:
        self.http.counts[(endpoint, str(code))] += 1

    def render(self, model_name: str, runtime_text: str, gauges: GatewayGauges) -> bytes:
        self.http.model_name, self.http.gauges = model_name, gauges
        return generate_latest(self.registry) + runtime_text.encode()


@dataclass(frozen=True)
class RouterCounts:
    """The router's own numbers at scrape time: its `stats` counters and live workers."""

    counters: dict[str, int]
    workers: int
    alive: int


def merge_worker_metrics(texts: dict[int, str], router: RouterCounts, viewer: Principal) -> str:
    """One exposition of several workers' texts, each sample labelled with its `worker` index
    (the same series from two workers must not collide), then the router's own counters. A
    tenant `viewer` sees what one runtime shows a tenant (TENANT_FAMILIES, its own tenant rows
    only), as in `stats`: the workers may have been asked with the router's key."""
    families: dict[str, Metric] = {}
    model_name = ""
    mine = None if viewer.admin else tenant_label(viewer.tenant)
    for index, text in sorted(texts.items()):
        for parsed in text_string_to_metric_families(text):
            if mine is not None and parsed.name not in TENANT_FAMILIES:
                continue
            family = families.setdefault(
                parsed.name, Metric(parsed.name, parsed.documentation, parsed.type)
            )
            for s in parsed.samples:
                model_name = model_name or s.labels.get(MODEL, "")
                if mine is None or s.labels.get("tenant", mine) == mine:
                    family.add_sample(s.name, {**s.labels, "worker": str(index)}, s.value)
    registry = CollectorRegistry()
    own = _router_families(router, model_name)
    if mine is not None:  # the fleet's shape only: the routing counters count everyone's requests
        own = [f for f in own if f.name in ROUTER_SHAPE]
    registry.register(_Fixed([*families.values(), *own]))
    return generate_latest(registry).decode()


ROUTER_SHAPE = frozenset({"radixrt_router_workers", "radixrt_router_workers_alive"})


def _router_families(router: RouterCounts, model_name: str) -> list[Metric]:
    routed = CounterMetricFamily(
        "radixrt_router_requests", "generates routed, by the policy's reason",
        labels=[MODEL, "reason"],
    )  # fmt: skip
    for key, n in router.counters.items():
        if key.startswith("routed_by_"):
            routed.add_metric([model_name, key.removeprefix("routed_by_")], n)
    resent = CounterMetricFamily(
        "radixrt_router_resent_requests",
        "generates re-sent after a worker was lost",
        labels=[MODEL],
    )
    resent.add_metric([model_name], router.counters.get("resent_requests", 0))
    lost = CounterMetricFamily(
        "radixrt_router_lost_requests", "streams ended with worker_lost", labels=[MODEL]
    )
    lost.add_metric([model_name], router.counters.get("lost_requests", 0))
    workers = GaugeMetricFamily("radixrt_router_workers", "workers configured", labels=[MODEL])
    workers.add_metric([model_name], router.workers)
    alive = GaugeMetricFamily("radixrt_router_workers_alive", "workers in rotation", labels=[MODEL])
    alive.add_metric([model_name], router.alive)
    return [routed, resent, lost, workers, alive]


class _Fixed:
    """A collector of families built beforehand."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
