"""Every HTTP route against a hostile caller (issue 53, item 8), driven by one table: each route
with a body it would accept, then probed oversized, deeply nested, with each field of the wrong
type, with a body that stalls, and from another site. Each probe is answered 4xx (never 5xx,
never a hang), `/health` answers meanwhile, and the gateway's memory does not grow. A route added
to the app and not to ROUTES fails `test_every_route_is_in_the_table`, so a new route is covered
by being added here. The CPU-heavy steps (tokenize, count_tokens) are driven concurrently while
`/health` is timed. The tiny random model; a keyless server, as a browser on the same machine
would find it. Then every route as a tenant of a keyed server with LoRA adapters (issue 60,
item 6): no reply, nor the ZeroMQ ops, names a path of the server."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

import radixrt
from radixrt.client.endpoint import RuntimeEndpoint
from radixrt.client.transport import RemoteError
from radixrt.server.http.app import build_app
from radixrt.server.http.gateway import Gateway

from helpers import gateway_pid, make_lora_adapter, rss_mib
from timeouts import REPLY_TIMEOUT_S

MAX_PROMPT_BYTES = 1 << 20  # --max-prompt-bytes here
CHAT = [{"role": "user", "content": "hi"}]
# (method, path) -> a body the route would accept (None: the route takes none). Probes send
# mutations of it, never it: a control op here must not run.
ROUTES: dict[tuple[str, str], dict | None] = {
    ("POST", "/v1/completions"): {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    ("POST", "/v1/chat/completions"): {"model": "tiny", "messages": CHAT, "max_tokens": 1},
    ("POST", "/v1/embeddings"): {"model": "tiny", "input": "hi"},
    ("POST", "/v1/messages"): {"model": "tiny", "messages": CHAT, "max_tokens": 1},
    ("POST", "/v1/messages/count_tokens"): {"model": "tiny", "messages": CHAT},
    ("POST", "/v1/responses"): {"model": "tiny", "input": "hi", "max_output_tokens": 1},
    ("GET", "/v1/responses/{response_id}"): None,
    ("DELETE", "/v1/responses/{response_id}"): None,
    ("GET", "/v1/models"): None,
    ("GET", "/health"): None,
    ("GET", "/metrics"): None,
    ("POST", "/generate"): {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    ("POST", "/abort_request"): {"rid": "r"},
    ("POST", "/tokenize"): {"prompt": "hi"},
    ("POST", "/detokenize"): {"tokens": [1, 2]},
    ("POST", "/pin"): {"pin_id": "p", "text": "hi"},
    ("POST", "/unpin"): {"pin_id": "p"},
    ("POST", "/load_lora_adapter"): {"lora_name": "a", "lora_path": "/nonexistent"},
    ("POST", "/unload_lora_adapter"): {"lora_name": "a"},
    ("GET", "/list_lora_adapters"): None,
    ("POST", "/flush_cache"): None,
    ("GET", "/get_model_info"): None,
    ("GET", "/get_server_info"): None,
    ("GET", "/server_info"): None,
    ("POST", "/concate_and_append_request"): {"src_rids": ["a"], "dst_rid": "b"},
    ("GET", "/health_generate"): None,
    ("POST", "/update_weights_from_disk"): {"model_path": "/nonexistent"},
    ("POST", "/init_weights_update_group"): {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
    },
    ("POST", "/update_weights_from_distributed"): {
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[1]],
    },
    ("POST", "/destroy_weights_update_group"): {"group_name": "g"},
    ("POST", "/pause_generation"): {"mode": "abort"},
    ("POST", "/continue_generation"): None,
    ("POST", "/release_memory_occupation"): None,
    ("POST", "/resume_memory_occupation"): None,
    ("GET", "/get_weight_version"): None,
}
WRONG = {"nested": [1, {"deeper": None}]}  # no field of any route takes this
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir):
    with runtimes.lease(
        tiny_model_dir, http=True, max_total_tokens=4096, max_prompt_bytes=MAX_PROMPT_BYTES
    ) as r:
        yield r


@pytest.fixture(scope="module")
def figures():
    """What the probes measured, printed at the end (`pytest -s` shows it)."""
    found: dict[str, list[float]] = {}
    yield found
    for name, values in found.items():
        print(
            f"{name}: max {max(values):.1f}, median {statistics.median(values):.1f} (n={len(values)})"
        )


def _call(
    url: str, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path.replace("{response_id}", "resp_nothere"), body, sent)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _health_ms(url: str) -> float:
    start = time.perf_counter()
    status, _ = _call(url, "GET", "/health", None)
    assert status == 200
    return 1000 * (time.perf_counter() - start)


def _probes(method: str, body: dict | None) -> list[tuple[str, bytes | None, dict[str, str]]]:
    """(kind, body, extra headers) of every probe of one route."""
    probes: list[tuple[str, bytes | None, dict[str, str]]] = [
        ("cross-site origin", None, {"Origin": "http://evil.example"}),
        ("cross-site fetch", None, {"Sec-Fetch-Site": "cross-site"}),
        ("forged host", None, {"Host": "evil.example:30000"}),
        ("oversized", None, {"Content-Length": str(64 << 20)}),
    ]
    if method == "POST":
        probes += [
            ("deep", DEEP, {}),
            ("not an object", b"[1, 2]", {}),
            ("not json", b"{", {}),
            ("form post", b"a=b", {"Content-Type": "text/plain"}),
        ]
        probes += [
            ("wrong type", json.dumps({**body, k: WRONG}).encode(), {}) for k in (body or {})
        ]
    return probes


def test_every_route_is_in_the_table(runtime):
    """The app's routes are ROUTES' (a new route must come with its probes)."""
    app = build_app(Gateway(RuntimeEndpoint(runtime.url)))
    served = {
        (method, route.path)
        for route in app.routes
        if route.path not in ("/openapi.json",)
        for method in getattr(route, "methods", ()) or ()
        if method != "HEAD"
    }
    assert served == set(ROUTES)


def test_the_gateway_runs_without_torch(runtime, figures):
    """The gateway tokenizes and renders templates with transformers' tokenizer class alone: the
    model's config classes (and torch under them, a quarter GB resident) stay in the runtime.
    Runs before the probes: megabyte bodies leave the allocator's arenas larger."""
    pid = gateway_pid(runtime._proc.pid)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply = _call(
        runtime.http_url, "POST", "/v1/chat/completions", json.dumps(chat).encode()
    )
    assert status == 200, reply
    with open(f"/proc/{pid}/maps") as f:
        assert "libtorch" not in f.read()
    figures.setdefault("gateway RSS MiB", []).append(rss_mib(pid))
    assert rss_mib(pid) < 200, rss_mib(pid)


@pytest.mark.parametrize("route", sorted(ROUTES), ids=lambda r: f"{r[0]} {r[1]}")
def test_hostile_probes_get_4xx_and_cost_nothing(runtime, route, figures):
    """Each probe of the route: a 4xx with a JSON error, `/health` answering right after (and
    while a stalled body is pending), the gateway's RSS steady, the runtime serving on."""
    method, path = route
    for kind, body, headers in _probes(method, ROUTES[route]):
        if kind == "oversized" and method != "POST":
            continue
        if kind == "oversized":  # declared, not sent: refused by its length
            status, reply = _declared_only(runtime.http_url, path, headers)
        else:
            status, reply = _call(runtime.http_url, method, path, body, headers)
        assert 400 <= status < 500, (kind, status, reply[:300])
        assert "error" in json.loads(reply), (kind, reply[:300])
        figures.setdefault("health ms after a probe", []).append(_health_ms(runtime.http_url))
    if method == "POST":
        with _stalled_body(runtime.http_url, path):
            figures.setdefault("health ms beside a stalled body", []).append(
                _health_ms(runtime.http_url)
            )


def _declared_only(url: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", path)
    for name, value in {"Content-Type": "application/json", **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    reply = conn.getresponse()
    try:
        return reply.status, reply.read()
    finally:
        conn.close()


class _stalled_body:
    """A POST whose headers promise a body of which only the first bytes come."""

    def __init__(self, url: str, path: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{"
        )
        self.sock.sendall(head.encode())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_cpu_heavy_steps_leave_health_answering(runtime, figures):
    """Large /tokenize and count_tokens calls, several at once (each just under
    --max-prompt-bytes), run off the event loop: /health answers meanwhile, and so does an
    ordinary chat; one just over the bound is a 400 at once."""
    big = "hello world " * (MAX_PROMPT_BYTES // 12 - 16)
    jobs = [("/tokenize", {"prompt": big})] * 3 + [
        (
            "/v1/messages/count_tokens",
            {"model": "tiny", "messages": [{"role": "user", "content": big}]},
        )
    ] * 4
    statuses: list[int] = []

    def run(path: str, body: dict) -> None:
        statuses.append(_call(runtime.http_url, "POST", path, json.dumps(body).encode())[0])

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    latencies, chats = [], []
    while any(t.is_alive() for t in threads):
        latencies.append(_health_ms(runtime.http_url))
        start = time.perf_counter()
        chat = json.dumps(ROUTES["POST", "/v1/chat/completions"]).encode()
        assert _call(runtime.http_url, "POST", "/v1/chat/completions", chat)[0] == 200
        chats.append(1000 * (time.perf_counter() - start))
    for t in threads:
        t.join()
    assert all(s in (200, 429, 503) for s in statuses) and 200 in statuses, statuses
    figures.setdefault("health ms beside heavy jobs", []).extend(latencies)
    figures.setdefault("chat ms beside heavy jobs", []).extend(chats)
    assert max(latencies) < 2000, latencies  # seconds-long stalls were the bug; figures in the note
    over = json.dumps({"prompt": "x" * (MAX_PROMPT_BYTES + 1)}).encode()
    status, reply = _call(runtime.http_url, "POST", "/tokenize", over)
    assert status == 400 and b"max-prompt-bytes" in reply


def test_the_gateway_does_not_grow(runtime, figures):
    """Runs last in this module: after every probe above, the gateway's RSS is within a bound of
    what it was after its first requests."""
    pid = gateway_pid(runtime._proc.pid)
    before = rss_mib(pid)
    for route in sorted(ROUTES):
        for kind, body, headers in _probes(route[0], ROUTES[route]):
            if kind != "oversized":
                _call(runtime.http_url, route[0], route[1], body, headers)
    grown = rss_mib(pid) - before
    figures.setdefault("gateway RSS growth MiB over a second round", []).append(grown)
    assert grown < 64, grown
    assert runtime.generate("hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template_kwargs": {"messages": []}},
        {"chat_template_kwargs": {"conversations": []}},
        {"chat_template_kwargs": {"raise_exception": "x"}},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": "abc"}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
    ],
)
def test_chat_bodies_the_template_cannot_take_are_400(runtime, fields):
    """A template variable that would override the renderer's own, and a history whose tool
    calls are not OpenAI's shape, are 400 naming the field (they were 500s)."""
    body = {**ROUTES["POST", "/v1/chat/completions"], **fields}
    status, reply = _call(
        runtime.http_url, "POST", "/v1/chat/completions", json.dumps(body).encode()
    )
    assert status == 400, reply
    assert json.loads(reply)["error"]["code"] == "invalid_request"


# ---- a tenant never sees a server path (issue 60, item 6) --------------------------------------

TENANT = "tenant-key"
ADAPTERS = ("a1", "a2")


@pytest.fixture(scope="module")
def keyed(runtimes, tiny_model_dir, tmp_path_factory):
    """The tiny model under its default served name (its folder's name), two LoRA adapters
    loaded from their folders, and a key file without an admin key: the runtime then makes its
    own, which only it, its gateway and the launcher hold (`keyed.args.admin_api_key`)."""
    root = tmp_path_factory.mktemp("keyed")
    (root / "keys.txt").write_text(f"tenant:{TENANT}\n")
    for seed, name in enumerate(ADAPTERS):
        make_lora_adapter(tiny_model_dir, root / name, 2, ["q_proj", "v_proj"], seed=seed)
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        api_key_file=str(root / "keys.txt"),
        lora_paths=tuple(f"{name}={root / name}" for name in ADAPTERS),
        max_total_tokens=4096,
    ) as r:
        yield r


def _server_paths(*paths: Path) -> list[str]:
    """The absolute paths of this server that a reply could leak, as given and resolved: those
    named, the tests' temporary folder (the model's and the adapters' folders are in it), home
    (the default model and the caches), the Python environment and the source tree."""
    roots = [*paths, Path(sys.prefix), Path.home(), Path(radixrt.__file__).parent.parent]
    return sorted({str(p) for root in roots for p in (root, root.resolve())})


def _leaks(text: str, paths: list[str]) -> list[str]:
    return [p for p in paths if p in text]


def test_a_tenant_sees_no_server_path(keyed, tiny_model_dir, tmp_path_factory):
    """Every route as the tenant, with the body it would accept (the model named by its served
    name; a control op gets 401), and the errors that name a model or an adapter: no reply
    names a server path, and the model and adapters go by their served names. So do the ZeroMQ
    ops. The admin sees the paths (so the check would catch them), and the gateway, whose own
    calls use the runtime's own admin key, loaded the tokenizer from them."""
    served = tiny_model_dir.name
    paths = _server_paths(tmp_path_factory.getbasetemp())
    extra = {
        ("POST", "/v1/completions", "an adapter"): {"model": "a1", "prompt": "hi", "max_tokens": 1},
        ("POST", "/v1/completions", "no such model"): {"model": "nope", "prompt": "hi"},
        ("POST", "/generate", "no such adapter"): {"text": "hi", "lora_path": "nope"},
    }
    probes = {(*route, "as accepted"): body for route, body in ROUTES.items()} | extra
    replies = {}
    for (method, path, kind), body in sorted(probes.items()):
        if body is not None and "model" in body and kind == "as accepted":
            body = {**body, "model": served}
        sent = None if body is None else json.dumps(body).encode()
        status, reply = _call(
            keyed.http_url, method, path, sent, {"Authorization": f"Bearer {TENANT}"}
        )
        assert status < 500, (method, path, kind, reply[:300])
        replies[method, path, kind] = status, reply.decode()
    leaked = {probe: _leaks(text, paths) for probe, (_, text) in replies.items()}
    assert not any(leaked.values()), {probe: p for probe, p in leaked.items() if p}

    assert replies["POST", "/v1/chat/completions", "as accepted"][0] == 200  # tokenizer loaded
    assert replies["POST", "/v1/completions", "an adapter"][0] == 200
    status, text = replies["POST", "/v1/completions", "no such model"]
    assert status == 404 and served in text and all(a in text for a in ADAPTERS)
    status, text = replies["POST", "/generate", "no such adapter"]
    assert status == 400 and "no adapter named 'nope'" in text
    models = json.loads(replies["GET", "/v1/models", "as accepted"][1])["data"]
    assert [m["id"] for m in models] == [served, *ADAPTERS] and all("root" not in m for m in models)
    assert json.loads(replies["GET", "/list_lora_adapters", "as accepted"][1]) == [
        {k: v for k, v in a.items() if k != "path"} for a in keyed.list_lora_adapters()
    ]
    info = json.loads(replies["GET", "/get_model_info", "as accepted"][1])
    assert info["model"] == info["model_path"] == info["tokenizer_path"] == served
    server = json.loads(replies["GET", "/get_server_info", "as accepted"][1])
    assert server["served_model_name"] == served

    tenant = RuntimeEndpoint(keyed.url, api_key=TENANT, timeout=REPLY_TIMEOUT_S)
    try:
        info = tenant.model_info
        assert info["model"] == served and "model_path" not in info and "tokenizer_path" not in info
        assert [a["name"] for a in tenant.list_lora_adapters()] == list(ADAPTERS)
        seen = [info, tenant.list_lora_adapters(), tenant.stats(), tenant.metrics()]
        with pytest.raises(RemoteError) as refused:
            tenant.generate("hi", {"max_new_tokens": 1}, lora_path="nope")
        assert not _leaks(json.dumps(seen) + str(refused.value), paths)
    finally:
        tenant.close()

    # the admin: the runtime's own key, held by the launcher (the server has no other)
    admin = keyed.args.admin_api_key
    assert Path(keyed.model_info["model_path"]).resolve() == tiny_model_dir.resolve()
    assert all(_leaks(a["path"], paths) for a in keyed.list_lora_adapters())
    status, info = _call(
        keyed.http_url, "GET", "/get_model_info", None, {"Authorization": f"Bearer {admin}"}
    )
    assert status == 200 and _leaks(info.decode(), paths)
