"""A rollout engine for reinforcement learning (docs/rl.md): a trainer's weights taken in place from
disk and from tensors, matching a fresh server on the same weights, with no KV of older weights
ever reused; bad weights refused by name with the old ones kept; pauses, updates under load (each
output from one weight version), the KV pool released and resumed; admin only, through the
router to every worker."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
from safetensors.torch import save_file

import radixrt as rt
from radixrt.client.transport import AuthenticationError, InvalidRequestError

from helpers import launch_runtime
from timeouts import REPLY_TIMEOUT_S

ADMIN_KEY = "admin-key"
KEYS = "alice:alice-key\n"
PROMPT = [17, 923, 4058, 77, 1290, 33, 5021, 640, 12, 9001, 45, 3]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# the served runtime's pool: every K or V buffer of a layer is 64 MiB (2 KV heads x 16 dims x
# 4 bytes a token), large enough that a resident pool would show in the RSS
POOL_TOKENS = 1 << 19
POOL_BYTES = POOL_TOKENS * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x heads x dims x 4


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """The trainer: a few SGD steps of plain torch on the tiny model as transformers loads it,
    saved with save_pretrained (tokenizer files beside); its folder and its state_dict."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("trained")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.randint(3, 49152, (2, 24), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def served(tiny_model_dir, key_file):
    """The rollout engine: the tiny model behind ZeroMQ and HTTP, tenants and an admin key."""
    with launch_runtime(
        tiny_model_dir,
        http=True,
        api_key_file=str(key_file),
        admin_api_key=ADMIN_KEY,
        max_total_tokens=POOL_TOKENS,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def fresh(trained):
    """A server started on the trained weights: what an updated one must answer."""
    with launch_runtime(trained[0]) as r:
        yield r


def _generate(endpoint, params=GREEDY) -> dict:
    return endpoint.generate(input_ids=PROMPT, sampling_params=params)


def _same_answer(got: dict, want: dict, tolerance: float = 1e-5) -> None:
    """The same tokens, their logprobs within `tolerance` (1e-4 across tensor-parallel ranks,
    whose sums run in another order)."""
    assert got["output_ids"] == want["output_ids"]
    got_lp = [lp for lp, _ in got["meta_info"]["output_token_logprobs"]]
    want_lp = [lp for lp, _ in want["meta_info"]["output_token_logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=tolerance)


def _http(runtime, path: str, body: dict | None = None, key: str = ADMIN_KEY) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{runtime.http_url}{path}", data=data)
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _back_to_base(served, tiny_model_dir) -> None:
    served.continue_generation()
    served.update_weights_from_disk(str(tiny_model_dir), weight_version="base")


def test_update_from_disk_answers_as_a_fresh_server_and_recomputes_the_cache(
    served, fresh, trained, tiny_model_dir
):
    _back_to_base(served, tiny_model_dir)
    old = _generate(served)
    assert _generate(served)["meta_info"]["cached_tokens"] > 0  # the prompt is cached
    done = served.update_weights_from_disk(str(trained[0]), weight_version="step-1")
    assert done["success"] and done["weight_version"] == "step-1" and done["seconds"] > 0
    assert served.stats()["cached_tokens"] == 0

    new = _generate(served)
    assert new["meta_info"]["cached_tokens"] == 0  # recomputed under the new weights
    assert new["meta_info"]["weight_version"] == "step-1"
    _same_answer(new, _generate(fresh))
    assert new["meta_info"]["output_token_logprobs"] != old["meta_info"]["output_token_logprobs"]
    again = _generate(served)  # cached again, now under the new weights
    assert again["meta_info"]["cached_tokens"] > 0
    _same_answer(again, new)

    assert served.client.call("model_info", REPLY_TIMEOUT_S)["weight_version"] == "step-1"
    assert _http(served, "/get_weight_version") == (200, {"weight_version": "step-1"})
    status, info = _http(served, "/get_model_info")
    assert status == 200 and info["weight_version"] == "step-1"


def test_updates_over_http_number_themselves(served, trained, tiny_model_dir):
    _back_to_base(served, tiny_model_dir)
    status, body = _http(served, "/update_weights_from_disk", {"model_path": str(trained[0])})
    assert status == 200 and body["success"]
    assert body["weight_version"].isdigit()  # numbered by the runtime: its count of updates
    assert body["weight_version"] == served.get_weight_version()
    status, body = _http(served, "/update_weights_from_disk", {"model_path": "x", "epoch": 3})
    assert status == 400 and "epoch" in json.dumps(body)


def test_bad_weights_are_refused_by_name_and_the_old_ones_stay(served, trained, tmp_path):
    folder, state = trained
    served.update_weights_from_disk(str(folder), weight_version="good")
    before = _generate(served)

    renamed = {k.replace("mlp.up_proj", "mlp.up"): v for k, v in state.items()}
    shape = {**state, "model.layers.1.self_attn.q_proj.weight": torch.zeros(63, 64)}
    extra = {**state, "model.layers.0.mlp.extra.weight": torch.zeros(4)}
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    for i, (tensors, named) in enumerate(
        (
            (renamed, "model.layers.0.mlp.up_proj.weight"),
            (shape, "model.layers.1.self_attn.q_proj.weight"),
            (extra, "model.layers.0.mlp.extra.weight"),
        )
    ):
        bad = tmp_path / f"bad-{i}"
        bad.mkdir()
        shutil.copy(folder / "config.json", bad / "config.json")
        untied = {k: v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"}
        save_file(untied, bad / "model.safetensors")
        with pytest.raises(InvalidRequestError) as info:
            served.update_weights_from_disk(str(bad))
        assert info.value.code == "invalid_request" and named in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        served.update_weights_from_disk(str(other))
    assert "num_hidden_layers" in info.value.message
    with pytest.raises(InvalidRequestError):
        served.update_weights_from_disk(str(tmp_path / "missing"))

    assert served.get_weight_version() == "good"
    _same_answer(_generate(served), before)


def test_the_ops_are_the_admins(served, trained):
    alice = rt.RuntimeEndpoint(served.url, api_key="alice-key", timeout=REPLY_TIMEOUT_S)
    try:
        for call in (
            lambda: alice.update_weights_from_disk(str(trained[0])),
            lambda: alice.client.call("update_weights_from_tensor", REPLY_TIMEOUT_S, path="/tmp"),
            alice.pause_generation,
            alice.continue_generation,
            alice.release_memory_occupation,
            alice.resume_memory_occupation,
        ):
            with pytest.raises(AuthenticationError) as info:
                call()
            assert info.value.code == "unauthorized"
        assert alice.get_weight_version() == served.get_weight_version()
    finally:
        alice.close()
    for path in ("/update_weights_from_disk", "/pause_generation", "/release_memory_occupation"):
        status, _ = _http(
            served, path, {"model_path": "x"} if "update" in path else {}, "alice-key"
        )
        assert status == 401
    assert served.stats()["generation_paused"] is None and not served.stats()["memory_released"]


def test_an_update_under_load_waits_so_each_output_has_one_version(
    served, fresh, trained, tiny_model_dir
):
    """Three long requests run when the update arrives: it waits for them (they finish under
    the old weights), and three sent meanwhile are held, then served under the new ones."""
    _back_to_base(served, tiny_model_dir)
    short = {**GREEDY, "return_logprob": False}
    long = {**short, "max_new_tokens": 200}  # in flight long enough for the update to arrive
    old, new = _generate(served, short), _generate(fresh, short)
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(_generate, served, long) for _ in range(3)]
        _wait_for(lambda: served.stats()["running"] == 3)
        update = pool.submit(served.update_weights_from_disk, str(trained[0]), "under-load")
        _wait_for(lambda: served.stats()["weight_update_waiting"])
        later = [pool.submit(_generate, served, short) for _ in range(3)]
        assert update.result()["weight_version"] == "under-load"
        first_out, later_out = [f.result() for f in first], [f.result() for f in later]
    assert [r["meta_info"]["weight_version"] for r in first_out] == ["base"] * 3
    assert [r["meta_info"]["weight_version"] for r in later_out] == ["under-load"] * 3
    for r in first_out:  # greedy: the long outputs begin as the short one under the same weights
        assert r["output_ids"][: len(old["output_ids"])] == old["output_ids"]
    assert all(r["output_ids"] == new["output_ids"] for r in later_out)


def test_pause_abort_then_update_then_continue(served, fresh, trained, tiny_model_dir):
    _back_to_base(served, tiny_model_dir)
    long = {**GREEDY, "max_new_tokens": 400, "return_logprob": False}
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_generate, served, long) for _ in range(2)]
        _wait_for(lambda: served.stats()["running"] == 2)
        assert served.pause_generation("abort")
        for r in (f.result() for f in running):  # none lost: each answers with what it has
            assert r["meta_info"]["finish_reason"]["type"] == "abort"
            assert r["meta_info"]["weight_version"] == "base"
        held = pool.submit(_generate, served)
        time.sleep(0.5)
        assert not held.done() and served.stats()["waiting"] == 1  # paused: queued
        served.update_weights_from_disk(str(trained[0]), weight_version="after-pause")
        served.continue_generation()
        got = held.result()
    assert got["meta_info"]["weight_version"] == "after-pause"
    _same_answer(got, _generate(fresh))


def test_paused_in_place_keeps_requests_and_refuses_an_update(served, trained, tiny_model_dir):
    _back_to_base(served, tiny_model_dir)
    params = {**GREEDY, "max_new_tokens": 60, "return_logprob": False}
    alone = _generate(served, params)
    with ThreadPoolExecutor(2) as pool:
        job = pool.submit(_generate, served, params)
        _wait_for(lambda: served.stats()["running"] == 1)
        assert served.pause_generation("in_place")
        time.sleep(0.3)
        assert not job.done() and served.stats()["running"] == 1
        with pytest.raises(InvalidRequestError) as info:
            served.update_weights_from_disk(str(trained[0]))
        assert "paused in place" in info.value.message
        status, _ = _http(served, "/continue_generation", {})
        assert status == 200
        got = job.result()
    assert got["output_ids"] == alone["output_ids"]
    assert got["meta_info"]["weight_version"] == "base"
    with pytest.raises(InvalidRequestError):
        served.pause_generation("retract")


def test_the_http_endpoint_has_the_same_methods(served, trained, tiny_model_dir):
    """`rt.RuntimeEndpoint(http_url)` sends the rollout ops over SGLang's routes (the methods
    come from the ops' records, as the ZeroMQ endpoint's do) and returns what ZeroMQ returns;
    an op without a route is refused on the client."""
    _back_to_base(served, tiny_model_dir)
    web = rt.RuntimeEndpoint(
        served.http_url, api_key="alice-key", admin_api_key=ADMIN_KEY, timeout=REPLY_TIMEOUT_S
    )
    assert web.pause_generation("in_place") is True and web.continue_generation() is True
    done = web.update_weights_from_disk(str(trained[0]), weight_version="over-http")
    assert done["success"] and done["weight_version"] == "over-http" and "message" not in done
    assert web.get_weight_version() == served.get_weight_version() == "over-http"
    with pytest.raises(InvalidRequestError, match="mode"):
        web.pause_generation("retract")
    with pytest.raises(NotImplementedError, match="ZeroMQ op"):
        web.check_invariants()
    assert web.release_memory_occupation(["kv_cache"]) and web.resume_memory_occupation()
    _back_to_base(served, tiny_model_dir)


def test_release_and_resume_memory(served, tiny_model_dir):
    """The pool's buffers go and come back; on the CPU only the pages tokens were written to
    are ever resident (`memory_pool.lazy_zeros`), so the RSS a release frees, and a resume takes
    back, is the KV written so far, far below the pool's capacity."""
    _back_to_base(served, tiny_model_dir)
    want = _generate(served)
    process = psutil.Process(served._proc.pid)
    before = process.memory_info().rss
    assert served.release_memory_occupation()
    released = process.memory_info().rss
    assert released - before < 0.01 * POOL_BYTES  # nothing taken (a few pages of noise)
    assert served.stats()["memory_released"]
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_generate, served)
        time.sleep(0.5)
        assert not held.done()  # queued until the pool is back
        status, body = _http(served, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 200 and body["success"]
        got = held.result()
    assert process.memory_info().rss - released < 0.2 * POOL_BYTES
    _same_answer(got, want)
    assert got["meta_info"]["cached_tokens"] == 0  # the cache went with the pool


def test_an_update_through_the_router_reaches_every_worker(tiny_model_dir, trained, fresh):
    with launch_runtime(tiny_model_dir, dp_size=2) as fleet:
        fleet.generate(input_ids=PROMPT, sampling_params=GREEDY)
        done = fleet.update_weights_from_disk(str(trained[0]), weight_version="fleet-1")
        assert done["weight_version"] == "fleet-1"
        workers = fleet.stats()["workers"]
        assert [w["weight_version"] for w in workers] == ["fleet-1", "fleet-1"]
        assert all(w["cached_tokens"] == 0 for w in workers)
        want = _generate(fresh)
        for _ in range(2):  # whichever worker serves it
            _same_answer(_generate(fleet), want)
        assert fleet.pause_generation() and fleet.continue_generation()


def _wait_for(condition, timeout: float = REPLY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_serving_requantizes_new_weights(tiny_model_dir, trained, quantization):
    """In process: an int8 (int4) server updated to the trained weights answers as one started
    on them (their linears quantized the same way, from the new float weights)."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    from helpers import run_in_process

    def scheduler(folder) -> Scheduler:
        args = ServerArgs(
            model=str(folder), attention_backend="torch", max_total_tokens=512,
            quantization=quantization,
        )  # fmt: skip
        return Scheduler.from_server_args(args)

    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    updated, started = scheduler(tiny_model_dir), scheduler(trained[0])
    try:
        before = run_in_process(updated, [[PROMPT]], params)
        updated.update_weights(trained[0], checkpoint=True, version=None)
        assert (
            run_in_process(updated, [[PROMPT]], params)
            == run_in_process(started, [[PROMPT]], params)
            != before
        )
    finally:
        updated.close()
        started.close()


def test_engine_updates_from_tensor_and_disk_over_two_ranks(tiny_model_dir, trained, fresh):
    """`rt.Engine.update_weights_from_tensor` (the trainer's state_dict, in process) and from
    disk, over two tensor-parallel ranks (each loads its own shard as at start); a wrong name is
    refused by name with the old weights kept; the pool is released and resumed on both."""
    folder, state = trained
    want = _generate(fresh)
    with rt.Engine(
        model=str(tiny_model_dir), tp_size=2, log_level="warning", timeout=REPLY_TIMEOUT_S
    ) as engine:
        before = _generate(engine)
        bad = {k.replace("q_proj", "query"): v for k, v in state.items()}
        with pytest.raises(InvalidRequestError) as info:
            engine.update_weights_from_tensor(bad)
        assert "model.layers.0.self_attn.q_proj.weight" in info.value.message
        _same_answer(_generate(engine), before)

        assert engine.update_weights_from_tensor(list(state.items()))["weight_version"] == "1"
        got = _generate(engine)
        assert got["meta_info"]["cached_tokens"] == 0
        _same_answer(got, want, 1e-4)
        engine.update_weights_from_disk(str(tiny_model_dir))
        _same_answer(_generate(engine), before)
        engine.update_weights_from_disk(str(folder))
        assert engine.release_memory_occupation() and engine.resume_memory_occupation()
        got = _generate(engine)
        assert got["meta_info"]["weight_version"] == "3"
        _same_answer(got, want, 1e-4)


def test_update_from_a_trainers_group(served, fresh, trained, tiny_model_dir):
    """The trainer (this process) hosts a gloo group, the runtime joins it as rank 1 (over
    ZeroMQ), and the trainer broadcasts every weight (the update asked over HTTP): served as
    from disk."""
    import datetime

    import torch.distributed as dist

    from radixrt.client.launcher import free_port

    _back_to_base(served, tiny_model_dir)
    state = trained[1]
    names = [n for n in state if n != "lm_head.weight"]  # tied to the embedding
    port, wait = free_port(), datetime.timedelta(seconds=REPLY_TIMEOUT_S)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(served.init_weights_update_group, "127.0.0.1", port, 1, 2, "trainer")
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=wait)
        group = dist.ProcessGroupGloo(store, 0, 2, wait)
        assert joined.result()["success"]
        body = {
            "names": names,
            "dtypes": [str(state[n].dtype) for n in names],
            "shapes": [list(state[n].shape) for n in names],
            "group_name": "trainer",
            "weight_version": "from-group",
        }
        update = pool.submit(_http, served, "/update_weights_from_distributed", body)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for name in names:
            group.broadcast([state[name].contiguous()], options).wait()
        assert update.result() == (200, {**update.result()[1], "weight_version": "from-group"})
    assert served.destroy_weights_update_group("trainer")["success"]
    with pytest.raises(InvalidRequestError):
        served.update_weights_from_distributed(names[:1], ["float32"], [[1]], "trainer")
    _same_answer(_generate(served), _generate(fresh))


def test_a_join_to_a_silent_peer_never_stops_generation_and_is_answered(tiny_model_dir):
    """A trainer address that accepts the connection and never speaks (torch's TCPStore client
    waits there past any timeout of its own): the join runs beside the loop, so greedy requests
    keep finishing meanwhile, and the join is answered `timeout` at --weights-update-timeout.
    An address outside --weights-update-allowed-hosts is refused at once."""
    import socket

    from radixrt.client.transport import RemoteError

    timeout = 3.0
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    with (
        silent,
        launch_runtime(tiny_model_dir, weights_update_timeout=timeout) as runtime,
        ThreadPoolExecutor(1) as pool,
    ):
        start = time.monotonic()
        with pytest.raises(InvalidRequestError, match="weights-update-allowed-hosts"):
            runtime.init_weights_update_group("10.11.12.13", 29500, 1, 2, "far")
        assert time.monotonic() - start < 2
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        runtime.generate(input_ids=PROMPT, sampling_params=params)  # warm
        start = time.monotonic()
        join = pool.submit(
            runtime.init_weights_update_group, "127.0.0.1", silent.getsockname()[1], 1, 2, "hung"
        )
        tokens = 0
        while not join.done() and time.monotonic() - start < 3 * timeout:
            tokens += runtime.generate(input_ids=PROMPT, sampling_params=params)["meta_info"][
                "completion_tokens"
            ]
        with pytest.raises(RemoteError) as refused:
            join.result(timeout=REPLY_TIMEOUT_S)
        took = time.monotonic() - start
        assert refused.value.code == "timeout" and timeout <= took < timeout + 2
        assert tokens >= 8 * 3  # requests went on finishing while the join hung
        runtime.generate(input_ids=PROMPT, sampling_params=params)  # and still do
        # the name is free again: a second join is taken (and times out the same way)
        with pytest.raises(RemoteError, match="did not form"):
            runtime.init_weights_update_group("127.0.0.1", silent.getsockname()[1], 1, 2, "hung")
