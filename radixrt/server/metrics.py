"""Prometheus metrics of the HTTP gateway: its own request counters and latency histograms, plus
the runtime's numbers (`stats` op) read at each scrape."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no `*_created` series: the gateway process has no other metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# stats key -> (metric name, help, kind)
RUNTIME_STATS = {
    "running": ("radixrt_num_requests_running", "requests in the running batch", "gauge"),
    "waiting": ("radixrt_num_requests_waiting", "requests in the waiting queue", "gauge"),
    "cache_hit_rate": (
        "radixrt_cache_hit_rate",
        "cached prompt tokens / all prompt tokens since start",
        "gauge",
    ),
    "total_tokens": ("radixrt_kv_tokens", "KV slots in the token pool", "gauge"),
    "free_tokens": ("radixrt_kv_free_tokens", "free KV slots", "gauge"),
    "cached_tokens": ("radixrt_kv_cached_tokens", "KV slots held by the radix tree", "gauge"),
    "num_preemptions": ("radixrt_preemptions", "requests retracted to free memory", "counter"),
    "evicted_tokens": ("radixrt_evicted_tokens", "tokens evicted from the radix tree", "counter"),
    "host_total_tokens": ("radixrt_host_kv_tokens", "KV slots in the host tier", "gauge"),
    "host_used_tokens": ("radixrt_host_kv_used_tokens", "host-tier KV slots in use", "gauge"),
    "host_hit_tokens": (
        "radixrt_host_hit_tokens",
        "prompt tokens loaded back from the host tier instead of recomputed",
        "counter",
    ),
    "storage_hit_tokens": (
        "radixrt_storage_hit_tokens",
        "prompt tokens read from the disk tier instead of recomputed",
        "counter",
    ),
    "swapped_out_tokens": (
        "radixrt_swapped_out_tokens",
        "tokens of retracted requests kept on the host tier",
        "counter",
    ),
    "swapped_in_tokens": (
        "radixrt_swapped_in_tokens",
        "tokens of retracted requests loaded back at readmission",
        "counter",
    ),
    "spec_accepted_tokens": (
        "radixrt_spec_accepted_tokens",
        "speculative draft tokens the model agreed with",
        "counter",
    ),
    "spec_accept_length": (
        "radixrt_spec_accept_length",
        "mean tokens a request got from one forward verifying its draft",
        "gauge",
    ),
}


# stats()["tenants"][name] key -> (metric name, help, kind), labelled by tenant
TENANT_STATS = {
    "requests": ("radixrt_tenant_requests", "requests a tenant got queued", "counter"),
    "prompt_tokens": (
        "radixrt_tenant_prompt_tokens",
        "a tenant's admitted prompt tokens",
        "counter",
    ),
    "cached_prompt_tokens": (
        "radixrt_tenant_cached_prompt_tokens",
        "a tenant's prompt tokens served from its own cache",
        "counter",
    ),
    "timeouts": (
        "radixrt_tenant_timeouts",
        "a tenant's requests ended by their timeout",
        "counter",
    ),
    "rate_limited": ("radixrt_tenant_rate_limited", "a tenant's refused requests", "counter"),
    "running": ("radixrt_tenant_requests_running", "a tenant's running requests", "gauge"),
    "waiting": ("radixrt_tenant_requests_waiting", "a tenant's waiting requests", "gauge"),
}


class _RuntimeStats:
    """Collector over the last `stats` reply (refreshed by the /metrics handler before rendering)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self):
        for key, (name, helptext, kind) in RUNTIME_STATS.items():
            if key in self.stats:
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                    name, helptext
                )
                family.add_metric([], float(self.stats[key]))
                yield family
        tenants = self.stats.get("tenants", {})
        for key, (name, helptext, kind) in TENANT_STATS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, helptext, labels=["tenant"]
            )
            for tenant, counters in tenants.items():
                family.add_metric([tenant], float(counters[key]))
            yield family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixrt_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "radixrt_prompt_tokens", "prompt tokens of finished requests", registry=self.registry
        )
        self.cached_tokens = Counter(
            "radixrt_cached_prompt_tokens",
            "prompt tokens served from the radix cache",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "radixrt_generation_tokens", "generated tokens", registry=self.registry
        )
        self.ttft = Histogram(
            "radixrt_time_to_first_token_seconds",
            "arrival to first output token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "radixrt_inter_token_latency_seconds",
            "a request's mean time between two output tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "radixrt_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.runtime = _RuntimeStats()
        self.registry.register(self.runtime)

    def observe(self, meta: dict[str, Any], count_prompt: bool) -> None:
        """One finished sample; its prompt counts once per prompt, not once per sample."""
        if count_prompt:
            self.prompt_tokens.inc(meta["prompt_tokens"])
            self.cached_tokens.inc(meta["cached_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self.e2e.observe(meta["e2e_latency"])
        if meta.get("ttft") is not None:
            self.ttft.observe(meta["ttft"])
            if meta["completion_tokens"] > 1:
                self.itl.observe(
                    (meta["e2e_latency"] - meta["ttft"]) / (meta["completion_tokens"] - 1)
                )

    def render(self, stats: dict[str, Any]) -> bytes:
        self.runtime.stats = stats
        return generate_latest(self.registry)
