"""Multi-LoRA serving on real models with random peft adapters: each adapter's greedy tokens
equal transformers + peft, one batch mixes adapters and the base, each adapter is its own cache
namespace, adapters load and unload at run time, nothing leaks; and what cannot be served is
refused with one line."""

from __future__ import annotations

import re

import pytest
import torch

import radixrt as rt
from radixrt.engine.request import RequestScope
from radixrt.kernels.lora import Segments, dense_reference
from radixrt.models.lora import AdapterError, LoraBatch, LoraSite, LoraState
from radixrt.sampling_params import SamplingParams

from helpers import drain, hf_greedy, launch_runtime, make_lora_adapter, make_scheduler
from ownership import assert_all_free

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three adapters of the tiny model: rank 8 on every target, rank 4 on q and v under
    rsLoRA scaling, rank 2 on o and down."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": make_lora_adapter(tiny_model_dir, root / "a1", 8, ALL, seed=1),
        "a2": make_lora_adapter(
            tiny_model_dir, root / "a2", 4, ["q_proj", "v_proj"], seed=2, use_rslora=True
        ),
        "a3": make_lora_adapter(tiny_model_dir, root / "a3", 2, ["o_proj", "down_proj"], seed=3),
    }


def _paths(adapters) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in adapters.items())


@pytest.fixture(scope="module")
def scheduler(tiny_model_dir, adapters):
    """The tiny model in-process with the three adapters, two pool slots, and n-gram
    speculation (its verify forwards carry each request's adapter too)."""
    return make_scheduler(
        tiny_model_dir,
        lora_paths=_paths(adapters),
        max_loras_per_batch=2,
        speculative_algorithm="ngram",
    )


def _run(scheduler, jobs: list[tuple[list[int], str]], **params) -> list:
    """Submit every (prompt, adapter) at once, step until done; the requests in order."""
    reqs = []
    for i, (prompt, lora) in enumerate(jobs):
        sampling = SamplingParams.from_dict({**GREEDY, **params})
        req = scheduler.make_request(f"r{i}", prompt, sampling, scope=RequestScope(lora_path=lora))
        scheduler.add_request(req)
        reqs.append(req)
    drain(scheduler, lambda s: s.check_invariants())
    return reqs


def _assert_clean(scheduler) -> None:
    """Invariant 2: after a flush with nothing running, every slot and row is free."""
    scheduler.check_invariants()
    assert scheduler.flush_cache()
    assert_all_free(scheduler.memory_snapshot())


def test_mixed_batch_each_request_equals_transformers_peft(tiny_model_dir, adapters, scheduler):
    """One submission mixing three adapters and the base over two prompts: each answer is its
    own adapter's (transformers + peft), and they all differ. Two slots for three adapters: the
    planner holds the third back until a slot's adapter is done, and the pool evicts."""
    prompts = [list(range(100, 124)), [300, 301, 302, 303, 304] * 5]
    names = ("", "a1", "a2", "a3")
    want = {n: hf_greedy(tiny_model_dir, prompts, MAX_NEW, adapters.get(n)) for n in names}
    assert len({tuple(w[0]) for w in want.values()}) == 4, "the adapters must change the answer"
    jobs = [(p, name) for name in ("a1", "", "a2", "a3") for p in prompts]
    reqs = _run(scheduler, jobs)
    for (prompt, name), req in zip(jobs, reqs):
        assert req.output_ids == want[name][prompts.index(prompt)], f"adapter {name!r}"
    assert len(scheduler.runner.lora.resident) == 2
    _assert_clean(scheduler)


def test_constraints_hold_under_an_adapter(scheduler):
    (req,) = _run(scheduler, [([5, 6, 7], "a1")], regex="[0-9]{3}-[a-z]{2}")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", req.text), req.text


def test_each_adapter_is_its_own_cache_namespace(scheduler):
    """A long prompt computed under a1 is cached for a1 alone: a2 and the base get nothing
    cached; a1 again gets the prefix."""
    prompt = list(range(1000, 1100))
    (first,) = _run(scheduler, [(prompt, "a1")])
    assert first.cached_tokens == 0
    other, base = _run(scheduler, [(prompt, "a2"), (prompt, "")])
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    (again,) = _run(scheduler, [(prompt, "a1")])
    assert again.cached_tokens >= len(prompt) - 1
    assert again.output_ids == first.output_ids
    _assert_clean(scheduler)


def test_adapters_that_do_not_fit_are_refused_with_one_line(
    tiny_model_dir, scheduler, tmp_path, default_model_dir
):
    big = make_lora_adapter(tiny_model_dir, tmp_path / "big", 16, ["q_proj"], seed=6)
    with pytest.raises(AdapterError, match="rank 16; this server takes at most 8") as e:
        scheduler.load_lora("big", str(big))
    assert "\n" not in str(e.value)
    other = make_lora_adapter(default_model_dir, tmp_path / "other", 2, ["q_proj"], seed=3)
    with pytest.raises(AdapterError, match="do not fit the base layer"):
        scheduler.load_lora("other", str(other))
    embed = make_lora_adapter(tiny_model_dir, tmp_path / "embed", 2, ["embed_tokens"], seed=4)
    with pytest.raises(AdapterError, match="adapts a module radixrt does not"):
        scheduler.load_lora("embed", str(embed))
    with pytest.raises(AdapterError, match="needs adapter_config.json"):
        scheduler.load_lora("none", str(tmp_path))
    with pytest.raises(AdapterError, match="already loaded"):
        scheduler.load_lora("a1", str(big))
    with pytest.raises(ValueError, match="no adapter named 'a9'"):
        _run(scheduler, [([5, 6, 7], "a9")])
    assert [a.name for a in scheduler.lora_adapters()] == ["a1", "a2", "a3"]


def test_delta_adds_to_an_int8_base():
    """A site's base may be any projection: over weight-only int8 the output is the int8
    product plus the adapter's delta."""
    from radixrt.kernels import int8_gemm
    from radixrt.models.linear import Int8Linear

    if not int8_gemm.available():
        pytest.skip("int8 weights need AVX2 and a C compiler")
    torch.manual_seed(0)
    base = Int8Linear.quantize(torch.randn(24, 40), None)
    a, b = torch.randn(2, 40, 8), torch.randn(2, 8, 24)
    state = LoraState()
    site = LoraSite(base, a, b, state)
    x, row_slots = torch.randn(5, 40), [1, -1, 0, 1, 1]
    state.batch = LoraBatch(Segments.of(row_slots))
    want = base(x) + dense_reference(x, a, b, row_slots)
    torch.testing.assert_close(site(x), want, atol=1e-4, rtol=1e-4)


def test_adapters_at_run_time_over_every_door(tiny_model_dir, adapters):
    """A runtime started without adapters: load one over ZeroMQ, generate under it (a batch of
    adapter and base prompts), over native HTTP and OpenAI's `model`, list it in /v1/models, in
    a DSL program; unload it; a request naming it then gets `invalid_request` (over OpenAI, a
    404 `model_not_found`, as any name neither served nor loaded); nothing leaks."""
    import openai

    prompt = list(range(100, 124))
    want = {n: hf_greedy(tiny_model_dir, [prompt], MAX_NEW, adapters.get(n))[0] for n in ("", "a1")}
    with launch_runtime(
        tiny_model_dir, http=True, enable_lora=True, max_lora_rank=8, served_model_name="tiny"
    ) as runtime:
        info = runtime.load_lora_adapter("a1", str(adapters["a1"]))
        assert info["rank"] == 8 and [a["name"] for a in runtime.list_lora_adapters()] == ["a1"]
        outs = runtime.generate(
            input_ids=[prompt] * 3, sampling_params=GREEDY, lora_path=["a1", "", "a1"]
        )
        assert [o["output_ids"] for o in outs] == [want["a1"], want[""], want["a1"]]
        http = rt.RuntimeEndpoint(runtime.http_url)
        assert (
            http.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a1")["output_ids"]
            == want["a1"]
        )
        text = runtime.tokenizer.decode(prompt)
        native = http.generate(text, {**GREEDY}, lora_path="a1")
        with openai.OpenAI(base_url=f"{runtime.http_url}/v1", api_key="none") as client:
            done = client.completions.create(
                model="a1", prompt=text, max_tokens=MAX_NEW, temperature=0
            )
            assert done.choices[0].text == native["text"]
            models = [(m.id, getattr(m, "parent", None)) for m in client.models.list()]
        assert models == [("tiny", None), ("a1", "tiny")]

        @rt.function
        def answer(s):
            s += prompt_text
            s += rt.gen("out", max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

        prompt_text = text
        state = answer.run(backend=runtime, lora_path="a1")
        assert state["out"] == native["text"]

        assert runtime.unload_lora_adapter("a1")
        with pytest.raises(Exception) as refused:
            runtime.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a1")
        assert refused.value.code == "invalid_request"
        assert "no adapter named 'a1'" in str(refused.value)
        with openai.OpenAI(base_url=f"{runtime.http_url}/v1", api_key="none") as client:
            for name in ("a1", "tiny-typo"):  # unloaded, or never: the base model never answers
                with pytest.raises(openai.NotFoundError) as missing:
                    client.completions.create(model=name, prompt=text, max_tokens=1)
                assert missing.value.code == "model_not_found" and name in str(missing.value)
        runtime.check_invariants()
        assert runtime.flush_cache()
        assert_all_free(runtime.memory_snapshot())


def test_two_ranks_equal_one(tiny_model_dir, adapters):
    """Under --tp-size 2 on gloo, A and B sharded as their base layers: a mixed batch's greedy
    tokens equal transformers + peft (as tp_size 1's do)."""
    prompt = list(range(100, 124))
    want = {
        n: hf_greedy(tiny_model_dir, [prompt], MAX_NEW, adapters.get(n))[0]
        for n in ("", "a1", "a2")
    }
    paths = list(_paths(adapters))[:2]
    with launch_runtime(tiny_model_dir, tp_size=2, lora_paths=paths) as runtime:
        names = ["a1", "", "a2"]
        outs = runtime.generate(input_ids=[prompt] * 3, sampling_params=GREEDY, lora_path=names)
        assert [o["output_ids"] for o in outs] == [want[n] for n in names]
        assert runtime.flush_cache()
        assert_all_free(runtime.memory_snapshot())


def test_default_model_equals_transformers_peft(default_model_dir, tmp_path):
    """Invariant 1 under an adapter on the default model (the tiny model's tests show the
    adapters change the answer)."""
    adapter = make_lora_adapter(default_model_dir, tmp_path / "d1", 8, ALL, seed=5, lora_alpha=8)
    prompt = list(range(200, 232))
    want = hf_greedy(default_model_dir, [prompt], MAX_NEW, adapter)[0]
    scheduler = make_scheduler(default_model_dir, lora_paths=(f"d1={adapter}",))
    (req,) = _run(scheduler, [(prompt, "d1")])
    assert req.output_ids == want


def test_adapter_namespaces_are_apart_from_salts_and_from_each_other():
    """Model-free: an adapter's cache namespace (the worker's salt, the router's tree key)
    differs from the base's, from every tenant's salt, from another adapter's, and from the
    same adapter with other weights."""
    from radixrt.server.router.prefix_tree import Namespace
    from radixrt.server.router.router import namespace_of

    base = RequestScope("alice", "s")
    salts = {
        base.salt,
        RequestScope(lora_path="a1", lora_digest="d1").salt,
        RequestScope(lora_path="a1", lora_digest="d2").salt,
        RequestScope(lora_path="a2", lora_digest="d1").salt,
        RequestScope("alice", "s", lora_path="a1", lora_digest="d1").salt,
        RequestScope("", "L2:a1:d1:0::").salt,  # a salt spelling an adapter's namespace
        RequestScope().salt,
    }
    assert len(salts) == 7
    assert namespace_of("alice", {"lora_path": "a1"}) == Namespace("alice", "", "a1")
    assert namespace_of("alice", {}) != namespace_of("alice", {"lora_path": "a1"})
    with pytest.raises(ValueError, match="lora_path must be a string"):
        RequestScope.from_fields("", {"lora_path": 3})


def test_lora_paths_take_sglangs_dict():
    """`rt.Engine(lora_paths={name: path})`, SGLang's form, is the `name=path` list."""
    args = rt.ServerArgs.from_kwargs(lora_paths={"a1": "/adapters/a1", "a2": "/adapters/a2"})
    assert args.lora_paths == ("a1=/adapters/a1", "a2=/adapters/a2")
    assert args.executor.lora_enabled
    assert "--lora-paths=a2=/adapters/a2" in args.to_cli_args()
    with pytest.raises(ValueError, match="name=path"):
        rt.ServerArgs(lora_paths={"": "/adapters/a1"})
