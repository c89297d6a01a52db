"""What tenants may keep in a server's memory, on one real runtime (tiny model, a key file of
three tenants): stored Responses bounded per tenant by the bytes they hold (a chain's earlier
turns included), reasoning items that are text parts only, pins drawing on one shared budget
that never leaves another tenant's request waiting, and the tenant name `default` reserved."""

from __future__ import annotations

import random
import time

import pytest

import radixrt as rt
from radixrt.client.transport import RemoteError
from radixrt.server.tenants import KeyRing

from helpers import http_json
from ownership import assert_no_leak
from timeouts import REPLY_TIMEOUT_S

ADMIN = "admin-key"
KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key"}
POOL = 1024
STORE_BYTES = 7500  # per tenant: two turns of TURN_TEXT (~3.3 kB each with its body; a third adds 1.6 kB), not three
TURN_TEXT = "the river " * 150  # 300 tokens: three turns fit the tiny model's context
ANSWERED_WITHIN_S = 30.0  # the request waited past this with no answer


@pytest.fixture(scope="module")
def runtime(runtimes, tiny_model_dir, tmp_path_factory):
    """Pins may fill 90% of the pool, so two tenants can pin nearly all of it."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    with runtimes.lease(
        tiny_model_dir,
        http=True,
        max_total_tokens=POOL,
        api_key_file=str(key_file),
        admin_api_key=ADMIN,
        max_pinned_fraction=0.9,
        max_stored_response_bytes_per_tenant=STORE_BYTES,
    ) as r:
        yield r


def _endpoint(runtime, tenant: str) -> rt.RuntimeEndpoint:
    return rt.RuntimeEndpoint(
        runtime.url, api_key=KEYS[tenant], admin_api_key=ADMIN, timeout=REPLY_TIMEOUT_S
    )


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _respond(runtime, tenant: str, body: dict) -> tuple[int, dict]:
    body = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, **body}
    return http_json(f"{runtime.http_url}/v1/responses", body, key=KEYS[tenant])


def test_a_reasoning_summary_is_text_parts_only(runtime):
    """The issue's body: a `reasoning` item whose summary is a million empty lists (3.9 MB of
    JSON, ~94 MB as Python objects once stored) is refused by name; the server serves on."""
    bad = {"type": "reasoning", "summary": [[] for _ in range(1000)]}
    status, reply = _respond(runtime, "alice", {"input": [bad, {"role": "user", "content": "Hi"}]})
    assert status == 400 and reply["error"]["code"] == "invalid_request"
    assert "summary" in reply["error"]["message"]
    parts = [{"type": "summary_text", "text": "thought"}] * 65  # one past the bound
    status, reply = _respond(runtime, "alice", {"input": [{"type": "reasoning", "summary": parts}]})
    assert status == 400 and "summary" in reply["error"]["message"]
    ok = {"type": "reasoning", "summary": parts[:2]}
    status, reply = _respond(runtime, "alice", {"input": [ok, {"role": "user", "content": "Hi"}]})
    assert status == 200 and reply["status"] in ("completed", "incomplete")


def test_a_chain_counts_against_its_tenants_store(runtime):
    """Each chained turn keeps the earlier ones: once the conversation would pass the tenant's
    bytes it is refused before it runs (`store: false` still runs it), and another tenant's
    store is its own."""
    status, first = _respond(runtime, "alice", {"input": TURN_TEXT})
    assert status == 200, first
    status, second = _respond(
        runtime, "alice", {"input": TURN_TEXT, "previous_response_id": first["id"]}
    )
    assert status == 200
    third = {"input": TURN_TEXT, "previous_response_id": second["id"]}
    status, refused = _respond(runtime, "alice", third)
    assert status == 400 and refused["error"]["code"] == "invalid_request"
    assert "--max-stored-response-bytes-per-tenant" in refused["error"]["message"]
    status, unstored = _respond(runtime, "alice", {**third, "store": False})
    assert status == 200 and unstored["usage"]["input_tokens"] > second["usage"]["input_tokens"]
    status, fetched = http_json(f"{runtime.http_url}/v1/responses/{first['id']}", key=KEYS["alice"])
    assert status == 200 and fetched == first
    status, _ = _respond(runtime, "bob", {"input": TURN_TEXT})
    assert status == 200, "bob's store is his own"


def test_pins_never_leave_another_tenants_request_waiting(runtime):
    """Alice and bob pin 440 tokens each (880 of the 921-token budget, nearly all the pool);
    carol's 440-token prompt is answered within ANSWERED_WITHIN_S, room made from the pins
    past their shares (921 // 3); a prompt that pins within their shares leave no room for is
    refused `overloaded` at once; the server keeps no slot."""
    alice, bob, carol = (_endpoint(runtime, t) for t in ("alice", "bob", "carol"))
    params = {"max_new_tokens": 1, "temperature": 0}
    try:
        for k, endpoint in enumerate((alice, bob)):
            prefix = _prompt(440, seed=k)
            endpoint.generate(input_ids=prefix, sampling_params=params)
            assert endpoint.pin("p", prefix) >= 439
        assert runtime.stats()["pins"] == 2
        start = time.monotonic()
        out = carol.generate(input_ids=_prompt(440, seed=7), sampling_params=params)
        assert time.monotonic() - start < ANSWERED_WITHIN_S
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert runtime.stats()["pins"] == 1, "alice's pin, past its share and older, went"
        assert not alice.unpin("p"), "released for carol"
        with pytest.raises(RemoteError) as refused:  # bob's 440 is within 921 // 2
            carol.generate(input_ids=_prompt(900, seed=8), sampling_params=params)
        assert refused.value.code == "overloaded" and "--max-pinned-fraction" in str(refused.value)
        assert time.monotonic() - start < ANSWERED_WITHIN_S
        assert bob.unpin("p")
    finally:
        for endpoint in (alice, bob, carol):
            endpoint.close()
    assert_no_leak(runtime)


def test_the_tenant_name_default_is_reserved(tmp_path):
    """`default` names the keyless (and the admin's) tenant's stats row: a key file's tenant of
    that name would be shown the admin's row, so the file is refused naming the line."""
    key_file = tmp_path / "keys.txt"
    key_file.write_text("alice:a-key\ndefault:d-key\n")
    with pytest.raises(ValueError, match=r"keys.txt:2: the tenant name 'default' is reserved"):
        KeyRing.from_settings(None, str(key_file), ADMIN)
