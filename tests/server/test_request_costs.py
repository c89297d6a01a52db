"""What one request may cost a runtime, on a real process (tiny model): a text over
`--max-prompt-bytes` refused before it is tokenized, a long text tokenized off the serving loop,
prompt logprobs capped, pins limited per tenant (count, id size; a pin of nothing refused), the
per-tenant defaults of a server with `--api-key-file` (queue caps, priority clamp), and a
tenant's `stats` showing only its own data."""

from __future__ import annotations

import random
import threading
import time
from functools import partial

import pytest
from transformers import AutoTokenizer

import radixrt as rt
from radixrt.client.transport import RemoteError
from radixrt.protocol import MAX_PIN_ID_CHARS

from helpers import finish_order
from ownership import assert_no_leak, wait_idle
from timeouts import REPLY_TIMEOUT_S

ADMIN_KEY = "admin-key"
KEYS = {"alice": "alice-key", "bob": "bob-key"}
LOGPROB_CAP = 1000
PINS = 2
QUEUE = 8  # --max-queued-requests: a tenant's default in-flight cap is a quarter of it
SHORT = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "über", "数据", "😀", "\n", "  "]


def _text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=chars // 3))[:chars]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _code(call) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        call()
    return info.value


@pytest.fixture(scope="module")
def costs(runtimes, tiny_model_dir, tmp_path_factory):
    """Two tenants without a maxprio, an admin; one request runs at a time (so priorities
    decide the order); no tenant cap given, so the key file's defaults hold."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    with runtimes.lease(
        tiny_model_dir,
        api_key_file=str(key_file),
        admin_api_key=ADMIN_KEY,
        max_running_requests=1,
        max_queued_requests=QUEUE,
        max_pins_per_tenant=PINS,
        max_prompt_logprob_entries=LOGPROB_CAP,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _endpoint(runtime, tenant: str) -> rt.RuntimeEndpoint:
    return rt.RuntimeEndpoint(runtime.url, api_key=KEYS[tenant], timeout=REPLY_TIMEOUT_S)


def test_a_text_over_the_byte_cap_is_refused_before_it_is_tokenized(costs):
    """4.5 MB of UTF-8 (default cap 4 MiB): tokenizing it would take about ten seconds on this
    machine; its refusal names the cap at once, and the runtime serves on."""
    alice = _endpoint(costs, "alice")
    try:
        text = _text(4 << 20)
        assert len(text.encode()) > 4 << 20
        start = time.monotonic()
        for op in ("generate", "tokenize"):
            fields = {"sampling_params": SHORT} if op == "generate" else {}
            error = _code(partial(alice.client.call, op, REPLY_TIMEOUT_S, text=text, **fields))
            assert error.code == "invalid_request" and "--max-prompt-bytes" in error.message
        assert time.monotonic() - start < 5
        assert alice.generate(input_ids=[5, 6, 7], sampling_params=SHORT)["output_ids"]
    finally:
        alice.close()


def test_a_long_text_is_tokenized_off_the_serving_loop(costs, tokenizer):
    """A generate sent while a 2 MiB text is being tokenized finishes first: the loop steps on
    meanwhile. Long texts give the same ids as the tokenizer, through every op that takes one."""
    alice, bob = _endpoint(costs, "alice"), _endpoint(costs, "bob")
    done: list[str] = []
    big: list[list[int]] = []

    def tokenize_big() -> None:
        big.append(alice.client.call("tokenize", REPLY_TIMEOUT_S, text=_text(2 << 20, seed=1)))
        done.append("tokenize")

    try:
        worker = threading.Thread(target=tokenize_big)
        worker.start()
        time.sleep(0.3)  # the text has arrived and is being tokenized
        assert bob.generate(input_ids=[5, 6, 7], sampling_params=SHORT)["output_ids"]
        done.append("generate")
        worker.join(REPLY_TIMEOUT_S)
        assert done == ["generate", "tokenize"] and len(big[0]) > 100_000
        text = _text(40_000, seed=2)  # past what is tokenized in the loop
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert alice.client.call("tokenize", REPLY_TIMEOUT_S, text=text) == expected
        long_prompt = tokenizer.decode(expected[:300]) + " " * 20_000  # within the context
        n = len(tokenizer.encode(long_prompt, add_special_tokens=False))
        out = alice.generate(long_prompt, sampling_params=SHORT)
        assert out["meta_info"]["prompt_tokens"] == n
        assert alice.pin("long", long_prompt) > 0 and alice.unpin("long")
        assert_no_leak(costs)
    finally:
        alice.close()
        bob.close()


def test_prompt_logprobs_past_the_cap_are_refused_by_name(costs):
    alice = _endpoint(costs, "alice")
    ids = _prompt(200, seed=3)
    asked = {"max_new_tokens": 1, "return_logprob": True, "logprob_start_len": 0}
    try:
        error = _code(
            lambda: alice.generate(input_ids=ids, sampling_params={**asked, "top_logprobs_num": 5})
        )
        assert error.code == "invalid_request"
        assert "--max-prompt-logprob-entries" in error.message and "1194" in error.message
        samples = {**asked, "n": 2, "top_logprobs_num": 2}  # 2 samples x 3 values x 199 tokens
        error = _code(lambda: alice.generate(input_ids=ids, sampling_params=samples))
        assert error.code == "invalid_request" and "1194" in error.message
        out = alice.generate(input_ids=ids, sampling_params={**asked, "top_logprobs_num": 3})
        meta = out["meta_info"]  # 4 x 199 = 796 values: under the cap
        assert [t for _, t in meta["input_token_logprobs"]] == ids  # the first's logprob None
        assert meta["input_top_logprobs"][0] is None
        assert all(len(top) == 3 for top in meta["input_top_logprobs"][1:])
        assert len(meta["input_top_logprobs"]) == 200
    finally:
        alice.close()


def test_pins_are_limited_per_tenant_and_must_hold_something(costs):
    """Two connections of one tenant share its pin count; another tenant has its own; a pin of
    nothing cached, or with an id that is not a short string, is refused."""
    alice, alice2, bob = (_endpoint(costs, t) for t in ("alice", "alice", "bob"))
    prefix = _prompt(40, seed=4)
    try:
        nothing = _code(lambda: alice.pin("cold", _prompt(40, seed=5)))
        assert nothing.code == "invalid_request" and "cached" in nothing.message
        for pin_id in ("", "x" * (MAX_PIN_ID_CHARS + 1), 7):
            call = partial(alice.client.call, "pin", REPLY_TIMEOUT_S, input_ids=prefix)
            bad = _code(partial(call, pin_id=pin_id))
            assert bad.code == "invalid_request" and "pin_id" in bad.message
        alice.generate(input_ids=prefix, sampling_params=SHORT)
        bob.generate(input_ids=prefix, sampling_params=SHORT)  # bob's own namespace
        assert alice.pin("a", prefix) == alice2.pin("a", prefix) == 40
        over = _code(lambda: alice2.pin("b", prefix))
        assert over.code == "rate_limited" and "--max-pins-per-tenant" in over.message
        assert bob.pin("a", prefix) == 40, "bob's pins are counted apart from alice's"
        assert alice.unpin("a") and alice2.pin("b", prefix) == 40
        for endpoint, pin_id in ((alice2, "a"), (alice2, "b"), (bob, "a")):
            assert endpoint.unpin(pin_id)
        assert_no_leak(costs)
    finally:
        for endpoint in (alice, alice2, bob):
            endpoint.close()


def test_a_key_file_gives_tenants_default_queue_caps(costs):
    """No tenant cap was given: with a key file a tenant may still have at most a quarter of
    the queue in flight, and queue at most four times the pool in prompt tokens."""
    alice, bob = _endpoint(costs, "alice"), _endpoint(costs, "bob")
    try:
        running = [
            alice.client.submit(input_ids=_prompt(8, seed=i), sampling_params=LONG)
            for i in range(QUEUE // 4)
        ]
        third = _code(lambda: alice.generate(input_ids=[5, 6], sampling_params=SHORT))
        assert third.code == "rate_limited" and f"at most {QUEUE // 4}" in third.message
        assert bob.generate(input_ids=[5, 6], sampling_params=SHORT)["output_ids"]
        for submission in running:
            alice.abort(submission.rid)
        wait_idle(costs)
        pool = costs.stats()["total_tokens"]
        flood = _code(
            lambda: alice.generate(input_ids=_prompt(4 * pool + 1, seed=6), sampling_params=SHORT)
        )
        assert flood.code == "rate_limited" and f"at most {4 * pool}" in flood.message
        assert_no_leak(costs)
    finally:
        alice.close()
        bob.close()


def test_a_tenants_priority_is_clamped_by_default(costs):
    """Neither tenant's key-file line sets a maxprio: alice's priority 100 counts as 0
    (`--tenant-max-priority`), so bob's request, queued before hers at 0, runs first."""
    alice, bob = _endpoint(costs, "alice"), _endpoint(costs, "bob")
    try:
        assert finish_order(costs, [("bob", bob, 0), ("alice", alice, 100)]) == ["bob", "alice"]
    finally:
        alice.close()
        bob.close()


def test_a_tenant_sees_only_its_own_stats(costs):
    """The admin sees cache salts, pins, hit totals and compile times; a tenant its own row and
    the server's shape and load, nothing other tenants' traffic moves."""
    alice = _endpoint(costs, "alice")
    try:
        alice.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
        full, mine = costs.stats(), alice.stats()
        for key in ("cache_salts", "pins", "cache_hit_rate", "cached_prompt_tokens_total",
                    "constraint_compiles", "step_time_s"):  # fmt: skip
            assert key in full and key not in mine, key
        assert set(mine["tenants"]) == {"alice"} and mine["total_tokens"] == full["total_tokens"]
        text = alice.metrics()
        assert "radixrt_tenant_requests" in text  # its own rows still render
        # ... but no timing of anyone's requests, nor counts of everyone's finishes and errors
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                     "queue_time", "request_success", "request_errors"):  # fmt: skip
            assert f"radixrt_{name}" in costs.metrics() and f"radixrt_{name}" not in text, name
    finally:
        alice.close()
