"""The command line answers bad input in one line and a non-zero exit, never a traceback; the
settings behind it check themselves by feature group, and `serve` and `router` share flags."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from radixrt.config import (
    BatchSettings,
    CacheSettings,
    FrontSettings,
    HttpSettings,
    ImageSettings,
    LoraSettings,
    ModelSettings,
    ParallelSettings,
    PrioritySettings,
    RouterArgs,
    RouterSettings,
    ServerArgs,
    SpeculativeSettings,
    StructuredSettings,
    TenantLimits,
)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["serve", "--model", "/nonexistent"], "/nonexistent"),
        (["serve", "--page-size", "0"], "page_size"),
        (["serve", "--max-total-tokens", "-5"], "max_total_tokens"),
        (["prepare-model", "--model", "/nonexistent"], "/nonexistent"),
        (["router"], "--worker"),
        (["router", "--worker", "tcp://127.0.0.1:1", "--router-cache-threshold", "2"], "router"),
        (["serve", "--model", "nobody/absent"], "not in the local Hugging Face Hub cache"),
        (["serve", "--chat-template", "/nonexistent.jinja"], "neither a file nor a Jinja"),
        (["serve", "--tokenizer-path", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_input_is_one_line(argv, words):
    proc = subprocess.run(
        [sys.executable, "-m", "radixrt", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"radixrt {argv[0]}: error:") and words in lines[0]


# ---- settings by feature group (model-free) ----------------------------------------------------
# (group, values it refuses, a word of the error): every group that has rules at least once
BAD_SETTINGS = [
    (ModelSettings, {"cpu_threads": -1}, "cpu_threads"),
    (ModelSettings, {"cpu_threads": 10**6}, "cpu_threads"),
    (ParallelSettings, {"tp_size": 0}, "tp_size"),
    (ParallelSettings, {"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "split"),
    (ParallelSettings, {"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
    (ParallelSettings, {"dp_size": 0}, "dp_size"),
    (ParallelSettings, {"tp_size": 4, "ep_size": 2}, "ep_size"),
    (RouterSettings, {"router_cache_threshold": 1.5}, "router_cache_threshold"),
    (RouterSettings, {"router_balance_rel_threshold": 0.5}, "router_balance_rel_threshold"),
    (BatchSettings, {"max_running_requests": 0}, "max_running_requests"),
    (BatchSettings, {"max_queued_requests": 0}, "max_queued_requests"),
    (CacheSettings, {"page_size": 0}, "page_size"),
    (CacheSettings, {"max_total_tokens": 0}, "max_total_tokens"),
    (CacheSettings, {"mem_fraction": 1.0}, "mem_fraction"),
    (CacheSettings, {"hicache_ratio": 0.0}, "hicache_ratio"),
    (CacheSettings, {"hicache_storage_size": 0.0}, "hicache_storage_size"),
    (CacheSettings, {"preemption_mode": "swap"}, "enable_hierarchical_cache"),
    (StructuredSettings, {"constraint_compile_timeout": 0.0}, "constraint_compile_timeout"),
    (StructuredSettings, {"constraint_compiles_per_tenant": 0}, "constraint_compiles_per_tenant"),
    (SpeculativeSettings, {"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
    (LoraSettings, {"max_loras_per_batch": 0}, "max_loras_per_batch"),
    (LoraSettings, {"max_lora_rank": 0}, "max_lora_rank"),
    (LoraSettings, {"lora_paths": ("nameless",)}, "name=path"),
    (LoraSettings, {"lora_paths": ("a=x", "a=y")}, "twice"),
    (PrioritySettings, {"priority_aging_s": 0.0}, "priority_aging_s"),
    (TenantLimits, {"max_pinned_tokens_per_client": 0}, "max_pinned_tokens_per_client"),
    (FrontSettings, {"max_frame_bytes": 100}, "max_frame_bytes"),
    (FrontSettings, {"drain_timeout": -1.0}, "drain_timeout"),
    (HttpSettings, {"http_request_timeout": 0.0}, "http_request_timeout"),
    (HttpSettings, {"http_pin_lease": -1.0}, "http_pin_lease"),
    (ImageSettings, {"limit_mm_per_prompt": "image=4"}, "limit_mm_per_prompt"),
    (ImageSettings, {"max_image_pixels": 0}, "max_image_pixels"),
    (ImageSettings, {"allowed_media_domains": ("https://a.example",)}, "allowed_media_domains"),
]


@pytest.mark.parametrize("group, values, words", BAD_SETTINGS)
def test_each_group_checks_its_bounds(group, values, words):
    """The group refuses the values by itself, and so does `ServerArgs` (which composes it)."""
    with pytest.raises(ValueError, match=words):
        group(**values)
    with pytest.raises(ValueError, match=words):
        ServerArgs(**values)


def test_every_group_with_rules_has_a_bounds_case():
    groups = {*ServerArgs.groups(), *RouterArgs.groups()}
    assert {group for group, _, _ in BAD_SETTINGS} == {g for g in groups if "check" in vars(g)}


@pytest.mark.parametrize(
    "values, words",
    [
        ({"quantization": "int3"}, "quantization"),
        ({"hicache_write_policy": "sometimes"}, "hicache_write_policy"),
        ({"router_policy": "random"}, "router_policy"),
        ({"tp_size": 2, "enable_hierarchical_cache": True}, "tp_size"),  # across two groups
    ],
)
def test_choices_and_rules_across_groups_are_checked(values, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs(**values)


def _parser(settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    settings.add_cli_args(parser)
    return parser


def test_help_lists_the_flags_by_group():
    sections = {g.title: g for g in _parser(ServerArgs)._action_groups}
    for group in ServerArgs.groups():
        section = sections[group.section]
        for f in dataclasses.fields(group):
            assert f.name in {a.dest for a in section._group_actions}, f.name
    text = subprocess.run(
        [sys.executable, "-m", "radixrt", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert all(
        f"\n{g.section}:" in text for g in (ModelSettings, CacheSettings, SpeculativeSettings)
    )


def test_router_flags_are_serves_for_the_same_setting():
    """One flag name, default, help and choices per setting in `serve` and `router`."""
    serve = {a.dest: a for a in _parser(ServerArgs)._actions}
    router = {a.dest: a for a in _parser(RouterArgs)._actions}
    # the router's --port is its clients' ZeroMQ port (DESIGN.md), serve's is HTTP: two settings
    shared = (set(serve) & set(router)) - {"help", "port"}
    assert {"router_policy", "router_cache_threshold", "host", "api_key_file"} <= shared
    for dest in shared:
        s, r = serve[dest], router[dest]
        assert r.option_strings[0] == s.option_strings[0], dest
        assert (r.default, r.help, r.choices) == (s.default, s.help, s.choices), dest
    assert router["router_policy"].option_strings == ["--router-policy", "--policy"]


@pytest.mark.parametrize(
    "settings",
    [
        ServerArgs(),
        ServerArgs(
            model="/m",
            page_size=4,
            mem_fraction=0.5,
            disable_radix_cache=True,
            enable_jump_forward=False,
            enable_hierarchical_cache=True,
            preemption_mode="swap",
            speculative_algorithm="ngram",
            router_cache_threshold=0.25,
            max_inflight_per_tenant=3,
            random_seed=-1,
        ),
        RouterArgs(worker=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), router_policy="round-robin"),
    ],
)
def test_to_cli_args_round_trips(settings):
    parsed = _parser(type(settings)).parse_args(settings.to_cli_args())
    assert type(settings).from_cli_args(parsed) == settings


def test_a_router_needs_a_worker():
    with pytest.raises(ValueError, match="--worker"):
        RouterArgs()
    with pytest.raises(ValueError, match="max_frame_bytes"):  # the front's rules, as serve's
        RouterArgs(worker=("tcp://127.0.0.1:1",), max_frame_bytes=100)


def test_a_path_is_served_by_its_last_part(tmp_path, monkeypatch):
    """The model's default served name never names a path of the server: an absolute path, or a
    file or folder here, goes by its last part; a Hub id or `default` as given."""
    folder = tmp_path / "models" / "tiny-llama"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for model in (str(folder), f"{folder}/", "models/tiny-llama", "./models/tiny-llama"):
        assert ServerArgs(model=model).model_name == "tiny-llama", model
    assert ServerArgs(model="~/m.gguf").model_name == "m.gguf"
    for model in ("default", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert ServerArgs(model=model).model_name == model
    assert ServerArgs(model=str(folder), served_model_name="tiny").model_name == "tiny"


def test_a_key_file_without_an_admin_key_gets_one_of_its_own(tmp_path):
    """`serve` and the launchers make an admin key where a key file names the tenants and none
    is given (their own calls then run as the admin); otherwise the keys stay as given."""
    keys = tmp_path / "keys.txt"
    own = ServerArgs(api_key_file=str(keys), api_key="k").with_own_admin_key()
    assert own.admin_api_key and own.admin_api_key != "k"
    assert ServerArgs(api_key_file=str(keys)).with_own_admin_key().admin_api_key != (
        own.admin_api_key
    )
    for given in ({}, {"api_key": "k"}, {"api_key_file": str(keys), "admin_api_key": "a"}):
        assert ServerArgs(**given).with_own_admin_key() == ServerArgs(**given)
