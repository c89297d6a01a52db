"""`BenchConfig` without a model: its defaults, the flags it shares with `radixrt serve`, the
command line round trip, every `radixrt bench` line of the Makefile and the docs parsed by the
generated parser, and the registry holding a suite for every workload."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
from pathlib import Path

import pytest

from radixrt.bench.config import WORKLOADS, BenchConfig
from radixrt.bench.registry import SUITES
from radixrt.bench.suites import suite_for
from radixrt.config import ServerArgs

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("model", "dtype", "max_total_tokens", "tp_size", "chunked_prefill_size")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixrt bench")
    BenchConfig.add_cli_args(parser)
    return parser


def _parse(argv: list[str]) -> BenchConfig:
    return BenchConfig.from_cli_args(_parser().parse_args(argv))


def test_defaults_are_the_flags_defaults():
    config = _parse([])
    assert config == BenchConfig()
    assert (config.workload, config.backend, config.max_total_tokens) == (
        "shared-prefix",
        "engine",
        None,  # each system at its own defaults
    )
    assert config.shape.num_requests == 64 and config.rates is None
    assert [load.describe() for load in config.loads] == ["all at once"]
    assert (config.slo.ttft_s, config.slo.tpot_s) == (1.0, 0.05)


def test_server_settings_are_the_servers_fields():
    """Same help and choices as `radixrt serve`'s flag; the server's default but for the pool,
    whose help says why the bench sets one."""
    bench, serve = BenchConfig.__dataclass_fields__, ServerArgs.__dataclass_fields__
    for name in SHARED:
        assert bench[name].metadata["help"].startswith(serve[name].metadata["help"]), name
        assert bench[name].metadata.get("choices") == serve[name].metadata.get("choices"), name
        if name != "max_total_tokens":
            assert bench[name].default == serve[name].default, name
    assert "every system has the same KV memory" in bench["max_total_tokens"].metadata["help"]


def test_flags_round_trip():
    config = BenchConfig(
        workload="random",
        systems="radixrt,radixrt-static",
        backend="server",
        chunked_prefill_size=512,
        sweep_rate="0.5,1",
        num_requests=12,
        fixed_output_len=True,
        temperature=1.0,
        max_concurrency=4,
        random_input_len=100,
    )
    assert _parse(config.to_cli_args()) == config
    assert config.rates == [0.5, 1.0] and [load.request_rate for load in config.loads] == [0.5, 1]


def test_help_lists_the_flags_by_group():
    parser = _parser()
    text = parser.format_help()
    for title in BenchConfig.sections():
        assert f"\n{title}:" in text
    helps = {action.dest: action.help or "" for action in parser._actions}
    assert helps["request_rate"].count("default:") == 1  # a help naming its default: once
    assert helps["slo_ttft"].endswith("(default: 1.0)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "agent-tools"], "add --backend http"),
        (["--systems", "radixrt,vllm"], "unknown systems"),
        (["--sweep-rate", "1,fast"], "could not convert"),
        (["--backend", "openai"], "go together"),
        (["--base-url", "http://127.0.0.1:8000"], "go together"),
        (
            ["--backend", "openai", "--base-url", "http://h", "--workload", "agent"],
            "request workload",
        ),
        (["--workload", "sharegpt"], "--dataset-path"),
        (["--batches", "1,x"], "--batches takes a comma list of positive whole numbers"),
        (["--contexts", "512,0"], "--contexts takes a comma list of positive whole numbers"),
        (["--batches", ","], "--batches takes a comma list"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--repeats", "-1"], "--repeats must be at least 1"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--gpu-sections", "check_kv_quant,check_all"], r"unknown --gpu-sections \['check_all'\]"),
        (["--workload", "flood-latency", "--systems", "llama-server"], "radixrt variants only"),
        (["--workload", "weight-update-time", "--systems", "transformers"], "variants only"),
    ],
)
def test_bad_combinations_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(argv)


def test_measure_settings_parse_and_leave_each_suite_its_default():
    """The in-process suites' knobs: comma lists of sizes, counts, and the GPU sections; unset,
    each suite takes its own default (so do --max-new-tokens and --systems)."""
    config = _parse(
        ["--workload", "decode-step", "--batches", "1, 32", "--contexts", "512", "--steps", "3"]
        + ["--repeats", "1", "--rounds", "7", "--gpu-sections", "check_kv_quant,bench_decode"]
    )
    assert (config.batch_sizes, config.context_lens, config.steps) == ([1, 32], [512], 3)
    assert _parse(config.to_cli_args()) == config
    unset = _parse([])
    assert unset.batch_sizes is None and unset.context_lens is None and unset.steps is None
    assert (
        unset.max_new_tokens is None and unset.new_tokens == 64 and unset.shape.max_new_tokens == 64
    )
    assert (unset.spec_workload, unset.gpu_sections) == ("agent-loop", None)
    assert _parse(["--workload", "flood-latency"]).systems_for("flood-latency") == ["radixrt"]
    assert (
        _parse(["--workload", "flood-latency", "--systems", "radixrt-dp2"]).systems == "radixrt-dp2"
    )


def test_every_workload_has_its_suite():
    assert set(SUITES) == {*WORKLOADS, "http", "openai"}
    remote = BenchConfig(backend="openai", base_url="http://127.0.0.1:8000", workload="random")
    assert suite_for(remote) is SUITES["openai"]
    for workload in WORKLOADS:
        backend = "http" if workload == "agent-tools" else "engine"
        dataset = "data.json" if workload == "sharegpt" else None
        config = BenchConfig(workload=workload, backend=backend, dataset_path=dataset)
        assert suite_for(config) is SUITES[workload]
    assert suite_for(BenchConfig(backend="http")) is SUITES["http"]


def _make_commands() -> list[str]:
    """The Makefile's `radixrt bench` commands, its variables expanded, each shell loop's
    variables at each of their values."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    # make reads the environment's variables too (HOME)
    variables = {**os.environ, **dict(re.findall(r"^(\w+)[ \t]*[:?]?=[ \t]*(.*)$", text, re.M))}

    def expand(match: re.Match[str]) -> str:
        name, _, substitution = match.group(1).partition(":")
        old, _, new = substitution.partition("=")
        return variables[name].replace(old, new) if old else variables[name]

    commands = []
    for line in re.sub(r"\$\((\w+(?::[^)]*)?)\)", expand, text).splitlines():
        loops = re.findall(r"for (\w+) in ([^;]+);", line)
        for body in re.findall(r"radixrt bench ([^;|]*)", line):
            for values in itertools.product(*(v.split() for _, v in loops)):
                command = body
                for (name, _), value in zip(loops, values):
                    command = command.replace(f"$${name}", value)
                commands.append(command)
    return commands


def _doc_commands() -> list[str]:
    """The docs' `radixrt bench ...` commands: code-block lines and inline code (a synopsis with
    [optional] parts aside)."""
    commands = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        commands += re.findall(r"^radixrt bench (.*)$", text, re.M)
        inline = re.findall(r"(?<!`)`radixrt bench([^`]*)`", text)
        commands += [" ".join(c.split()) for c in inline if "[" not in c]
    return commands


def test_every_bench_command_of_the_makefile_and_docs_parses():
    make, docs = _make_commands(), _doc_commands()
    assert len(make) >= 10 and len(docs) >= 10
    assert len({c for c in make if "spec-c8" in c}) == 4  # bench-spec's loop, each workload
    for command in make + docs:
        _parse(shlex.split(command))
    assert any("--sweep-rate" in c for c in make) and not any("$" in c for c in make)
