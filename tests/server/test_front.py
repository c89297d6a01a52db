"""The client front on real processes (tiny model): frame limits before authentication, roles
(control ops need the admin key), per-tenant stats, /metrics, priority caps from the key file,
the CURVE allowlist, prompt-size limits, and the same roles through a `--dp-size 2` fleet."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import msgpack
import psutil
import pytest
import zmq

import radixrt as rt
from radixrt.client.transport import AuthenticationError, InvalidRequestError
from radixrt.protocol import ADMIN_OPS
from radixrt.server.front import Role
from radixrt.server.router.router import Router
from radixrt.server.zmq_server import OPS

from helpers import finish_order, launch_runtime
from ownership import assert_no_leak
from timeouts import REPLY_TIMEOUT_S

ADMIN_KEY = "the-admin"
# alice's priority is capped at 1; bob's is not capped
KEY_FILE = "# tenant:key[:maxprio]\nalice:alice-key:1\nbob:bob:key-with-colons\n"
KEYS = {"alice": "alice-key", "bob": "bob:key-with-colons"}
FRAME_LIMIT = 16 << 20
SHORT = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}  # within the context


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    return path


@pytest.fixture(scope="module")
def guarded(runtimes, tiny_model_dir, key_file):
    """One request at a time (so priorities decide the order), tenants (those without a maxprio
    capped at 5), an admin key, HTTP."""
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        max_running_requests=1,
        api_key_file=str(key_file),
        admin_api_key=ADMIN_KEY,
        max_frame_bytes=FRAME_LIMIT,
        max_prompt_bytes=4096,
        tenant_max_priority=5,
    ) as r:
        yield r


def _endpoint(url: str, tenant: str, **kw) -> rt.RuntimeEndpoint:
    return rt.RuntimeEndpoint(url, api_key=KEYS[tenant], timeout=REPLY_TIMEOUT_S, **kw)


def _raw_dealer(ctx: zmq.Context, url: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def _reply(sock: zmq.Socket) -> dict:
    assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply"
    return msgpack.unpackb(sock.recv(), raw=False)


def test_the_op_tables_give_control_ops_the_admin_role():
    assert {op for op, entry in OPS.items() if entry.role is Role.ADMIN} == ADMIN_OPS
    table = Router._ops(object.__new__(Router))  # the table only names bound methods
    assert {op for op, entry in table.items() if entry.role is Role.ADMIN} == ADMIN_OPS
    assert set(table) == set(OPS), "the router and the runtime speak the same ops"


def test_strangers_frames_cost_no_memory_and_keyed_clients_are_served(guarded):
    """Frames of 64 MiB and of a million empty maps, without a key: the first is dropped by
    ZeroMQ, the second refused before it is built; a keyed client is served throughout."""
    proc = psutil.Process(guarded._proc.pid)
    alice = _endpoint(guarded.url, "alice")
    alice.generate(input_ids=[5, 6, 7], sampling_params=SHORT)  # warm: allocations settle
    before = proc.memory_info().rss
    # the key comes last, so the million maps must be skipped to find it
    bombs = [
        msgpack.packb({"op": "generate", "rid": "bomb", "x": [{}] * 10**6, **key})
        for key in ({}, {"api_key": "wrong-key"})
    ]
    ctx = zmq.Context()
    served = []
    try:
        for _ in range(3):
            huge = _raw_dealer(ctx, guarded.url)
            huge.send(b"\x80" * (64 << 20))
            stranger = _raw_dealer(ctx, guarded.url)
            for bomb in bombs:
                stranger.send(bomb)
                reply = _reply(stranger)
                assert reply["rid"] == "bomb" and reply["error"]["code"] == "unauthorized"
            out = alice.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
            served.append(out["meta_info"]["completion_tokens"])
            huge.close()
            stranger.close()
        # a keyed frame is decoded, within the container limits: too long a list is refused
        keyed = _raw_dealer(ctx, guarded.url)
        keyed.send(msgpack.packb({"api_key": KEYS["bob"], "rid": "long", "x": [0] * 3000}))
        assert _reply(keyed)["error"]["code"] == "invalid_request"
        keyed.close()
    finally:
        ctx.destroy(linger=0)
        alice.close()
    assert served == [4, 4, 4]
    growth = proc.memory_info().rss - before
    assert growth < FRAME_LIMIT, f"the runtime grew {growth / 2**20:.1f} MiB"
    assert_no_leak(guarded)


def test_control_ops_need_the_admin_key(guarded):
    alice = _endpoint(guarded.url, "alice")
    try:
        for call in (
            alice.flush_cache,
            alice.check_invariants,
            alice.memory_snapshot,
            lambda: alice.client.call("shutdown", REPLY_TIMEOUT_S),
        ):
            with pytest.raises(AuthenticationError) as info:
                call()
            assert info.value.code == "unauthorized" and "admin" in info.value.message
        assert alice.health()  # alice's shutdown stopped nothing
        assert alice.generate(input_ids=[5, 6], sampling_params=SHORT)["output_ids"]
    finally:
        alice.close()
    assert guarded.flush_cache()  # the launcher holds the admin key
    assert_no_leak(guarded)


def test_a_tenant_sees_only_its_own_stats_row(guarded):
    alice, bob = _endpoint(guarded.url, "alice"), _endpoint(guarded.url, "bob")
    try:
        alice.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
        bob.generate(input_ids=[5, 6, 8], sampling_params=SHORT)
        assert set(alice.stats()["tenants"]) == {"alice"}
        assert set(bob.stats()["tenants"]) == {"bob"}
        assert {"alice", "bob"} <= set(guarded.stats()["tenants"])
    finally:
        alice.close()
        bob.close()


def test_metrics_need_the_admin_key(guarded):
    url = f"{guarded.http_url}/metrics"
    for key in (None, KEYS["alice"], "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
        assert info.value.code == 401
    admin = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(admin, timeout=REPLY_TIMEOUT_S) as reply:
        assert reply.status == 200 and b"radixrt_" in reply.read()


def test_a_tenants_priority_is_capped_by_its_key_file_line(guarded):
    """One request runs at a time: behind a running one, alice asks priority 100 (capped to 1)
    before bob asks 5 (his line sets no maxprio: --tenant-max-priority 5), so bob's runs first."""
    admin = rt.RuntimeEndpoint(guarded.url, api_key=ADMIN_KEY, timeout=REPLY_TIMEOUT_S)
    alice, bob = _endpoint(guarded.url, "alice"), _endpoint(guarded.url, "bob")
    try:
        assert finish_order(admin, [("alice", alice, 100), ("bob", bob, 5)]) == ["bob", "alice"]
    finally:
        for e in (admin, alice, bob):
            e.close()
    assert_no_leak(guarded)


def test_prompts_above_max_prompt_bytes_are_refused(guarded):
    bob = _endpoint(guarded.url, "bob")
    try:
        for prompt in ("é" * 2049, [5] * 1025):  # 4098 bytes of UTF-8, 4100 bytes of ids
            with pytest.raises(InvalidRequestError) as info:
                bob.generate(prompt, SHORT)
            assert info.value.code == "invalid_request" and "max-prompt-bytes" in str(info.value)
        assert bob.generate([5] * 1000, SHORT)["output_ids"]  # 4000 bytes: within both limits
    finally:
        bob.close()


def test_the_curve_allowlist_lets_a_listed_key_in_and_keeps_another_out(tiny_model_dir, tmp_path):
    server_secret = zmq.curve_keypair()[1].decode()
    server_public = zmq.curve_public(server_secret.encode()).decode()
    listed_public, listed_secret = (k.decode() for k in zmq.curve_keypair())
    allowlist = tmp_path / "clients.txt"
    allowlist.write_text(f"# who may connect\n{listed_public}\n")
    with launch_runtime(
        tiny_model_dir,
        max_total_tokens=512,
        curve_secret_key=server_secret,
        curve_client_keys=str(allowlist),
        curve_client_secret_key=listed_secret,  # the launcher itself is on the list
    ) as r:
        assert r.generate(input_ids=[5, 6], sampling_params=SHORT)["output_ids"]
        other_secret = zmq.curve_keypair()[1].decode()
        for secret in (other_secret, None):  # another key pair, an ephemeral one
            with rt.RuntimeEndpoint(
                r.url, curve_server_key=server_public, curve_client_secret_key=secret
            ) as outsider:
                with pytest.raises(TimeoutError):
                    outsider.health(timeout=2)
        assert r.health()


def test_roles_and_tenants_through_a_dp_fleet(tiny_model_dir, key_file):
    """`serve --dp-size 2 --api-key-file`: the router forwards each client's key, so tenants,
    roles and per-tenant stats hold as on one runtime; the admin's shutdown stops the fleet."""
    fleet = launch_runtime(
        tiny_model_dir,
        dp_size=2,
        max_total_tokens=1024,
        api_key_file=str(key_file),
        admin_api_key=ADMIN_KEY,
    )
    alice, bob = _endpoint(fleet.url, "alice"), _endpoint(fleet.url, "bob")
    try:
        prompt = list(range(5, 45))
        assert alice.generate(input_ids=prompt, sampling_params=SHORT)["meta_info"]
        second = alice.generate(input_ids=prompt, sampling_params=SHORT)
        assert second["meta_info"]["cached_tokens"] > 0
        theirs = bob.generate(input_ids=prompt, sampling_params=SHORT)
        assert theirs["meta_info"]["cached_tokens"] == 0, "bob reused alice's prefix"
        for call in (alice.flush_cache, lambda: bob.client.call("shutdown", REPLY_TIMEOUT_S)):
            with pytest.raises(AuthenticationError):
                call()
        stats = alice.stats()
        assert set(stats["tenants"]) == {"alice"} and stats["tenants"]["alice"]["requests"] == 2
        assert all(set(w.get("tenants", {})) <= {"alice"} for w in stats["workers"])
        assert {"alice", "bob"} <= set(fleet.stats()["tenants"])
        assert fleet.flush_cache()
        assert fleet.client.call("shutdown", REPLY_TIMEOUT_S)
        fleet._proc.wait(timeout=60)
    finally:
        alice.close()
        bob.close()
        fleet.shutdown()


def test_curve_alone_no_longer_opens_a_non_loopback_bind(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXRT_")}
    env["RADIXRT_CURVE_SECRET_KEY"] = zmq.curve_keypair()[1].decode()
    command = [sys.executable, "-m", "radixrt", "serve", "--model", str(tiny_model_dir)]
    command += ["--host", "0.0.0.0", "--port", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "--curve-client-keys" in proc.stderr
