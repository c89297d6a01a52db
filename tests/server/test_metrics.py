"""/metrics against a real runtime: every series names its model, what ZeroMQ clients do reaches
it, the inter-token histogram counts each gap, the Grafana dashboard reads only series the server
exposes, and `promtool check metrics` accepts the text where promtool is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import radixrt as rt
from radixrt.client.transport import RemoteError
from radixrt.server.metrics import RouterCounts, merge_worker_metrics
from radixrt.server.tenants import OPEN

from timeouts import REPLY_TIMEOUT_S

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "radixrt.json"
NEW_TOKENS = 6


def scrape(runtime) -> str:
    with urllib.request.urlopen(f"{runtime.http_url}/metrics", timeout=REPLY_TIMEOUT_S) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def samples(text: str) -> dict[str, float]:
    """name{labels as JSON} -> value, for every sample; parsing checks the exposition format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def exposed_names(text: str) -> set[str]:
    """Every sample name the text declares, an empty family (no tenant yet) included."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in suffixes.get(family.type, [""])
    }


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables'."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_zmq_traffic_reaches_metrics_and_itl_counts_each_gap(tiny_runtime):
    """A ZeroMQ generate of 6 tokens adds one TTFT, queue-time and e2e sample, 5 ITL samples
    (each gap, not one mean) and a `length` finish; a refused one counts under its code."""
    label = '{"model_name": "tiny"}'
    before = samples(scrape(tiny_runtime))
    with rt.RuntimeEndpoint(tiny_runtime.url, timeout=REPLY_TIMEOUT_S) as zmq_client:
        zmq_client.generate(
            input_ids=[5, 6, 7, 8],
            sampling_params={"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0},
        )
        with pytest.raises(RemoteError):
            zmq_client.client.call("generate", REPLY_TIMEOUT_S, input_ids=[5], color=1)
    text = scrape(tiny_runtime)
    after = samples(text)

    def moved(name: str, labels: str = label) -> float:
        return after[name + labels] - before.get(name + labels, 0)

    assert moved("radixrt_inter_token_latency_seconds_count") == NEW_TOKENS - 1
    for name in ("time_to_first_token", "queue_time", "e2e_request_latency"):
        assert moved(f"radixrt_{name}_seconds_count") == 1, name
    assert moved("radixrt_generation_tokens_total") == NEW_TOKENS
    assert moved("radixrt_prompt_tokens_total") == 4
    success = '{"finished_reason": "length", "model_name": "tiny"}'
    assert moved("radixrt_request_success_total", success) == 1
    refused = '{"code": "invalid_request", "model_name": "tiny"}'
    assert moved("radixrt_request_errors_total", refused) == 1
    assert 0 <= after["radixrt_kv_usage_ratio" + label] <= 1
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == "tiny", s


def test_both_endpoints_read_the_metrics(tiny_runtime):
    """`metrics()` over ZeroMQ is the runtime's text; over HTTP, the gateway's counts come first."""
    with rt.RuntimeEndpoint(tiny_runtime.url, timeout=REPLY_TIMEOUT_S) as zmq_client:
        runtime_names = exposed_names(zmq_client.metrics())
    with rt.RuntimeEndpoint(tiny_runtime.http_url, timeout=REPLY_TIMEOUT_S) as http_client:
        http_names = exposed_names(http_client.metrics())
    assert "radixrt_time_to_first_token_seconds_count" in runtime_names
    gateway_names = {
        "radixrt_http_requests_total",
        "radixrt_http_in_flight",
        "radixrt_http_pin_leases",
    }
    assert not gateway_names & runtime_names
    assert http_names == runtime_names | gateway_names


def test_the_dashboard_reads_only_exposed_series(tiny_runtime):
    """Each PromQL expression of deploy/grafana/radixrt.json names series that a runtime's
    /metrics (gateway included) or a router's (the same merged, plus its own) declares."""
    text = scrape(tiny_runtime)
    router = merge_worker_metrics({0: text}, RouterCounts({"routed_by_match": 1}, 1, 1), OPEN)
    exposed = exposed_names(text) | exposed_names(router)
    exprs = dashboard_queries()
    assert exprs
    for expr in exprs:
        names = set(re.findall(r"radixrt_[a-z0-9_]+", str(expr)))
        assert names, expr
        assert names <= exposed, (expr, names - exposed)


def test_promtool_accepts_the_live_text_and_the_dashboard(tiny_runtime, tmp_path):
    """`promtool check metrics` on a live /metrics; the dashboard's panel queries (Grafana's
    variables filled in) parse as PromQL, checked as recording rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's `prometheus` package has it)")
    check = subprocess.run(
        [promtool, "check", "metrics"], input=scrape(tiny_runtime), capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    filled = [
        e.replace("$__rate_interval", "1m").replace("$model", ".*")
        for e in dashboard_queries()
        if not e.startswith("label_values(")  # a Grafana function, not PromQL
    ]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(filled)
    ]}]}  # fmt: skip
    (tmp_path / "rules.json").write_text(json.dumps(rules))  # JSON is YAML
    check = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.json")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_tenant_sees_no_ones_timings_from_a_runtime_or_a_fleet():
    """The admin's text has every request's histograms and finish counts; a tenant's (from one
    runtime, or merged by the router from texts the workers rendered for the admin) has only
    the server's shape and load and its own tenant rows."""
    from radixrt.server.metrics import ROUTER_SHAPE, TENANT_FAMILIES, RuntimeMetrics
    from radixrt.server.tenants import Principal

    metrics = RuntimeMetrics("m")
    metrics.ttft.observe(0.2)
    metrics.finish("stop")
    row = {"requests": 1, "prompt_tokens": 4, "cached_prompt_tokens": 0, "timeouts": 0,
           "rate_limited": 0, "running": 0, "waiting": 0}  # fmt: skip
    stats = {"running": 1, "waiting": 0, "tenants": {"alice": row, "bob": row}}
    admin_text = metrics.render(stats, admin=True)
    alice = Principal(tenant="alice")
    texts = {
        "runtime": metrics.render({**stats, "tenants": {"alice": row}}, admin=False),
        "fleet": merge_worker_metrics({0: admin_text}, RouterCounts({}, 1, 1), alice),
    }
    assert {"radixrt_time_to_first_token_seconds", "radixrt_request_success"} <= {
        f.name for f in text_string_to_metric_families(admin_text)
    }
    for where, text in texts.items():
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert "radixrt_num_requests_running" in families, where
        assert set(families) - ROUTER_SHAPE <= TENANT_FAMILIES, where
        tenants = {s.labels["tenant"] for s in families["radixrt_tenant_requests"].samples}
        assert tenants == {"alice"}, where
