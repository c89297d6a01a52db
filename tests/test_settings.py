"""The settings contract (model-free): each setting is declared once, in one group; every
setting of `serve` is a flag, an `rt.Engine` keyword and a row of docs/flags.md; components
receive groups, not restated copies of their settings."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from radixrt.bench.config import BenchConfig
from radixrt.config import RouterArgs, ServerArgs, Settings
from radixrt.flags_doc import render

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (ServerArgs, RouterArgs, BenchConfig)
# one name, two settings of two commands
SAME_NAME = {
    "port": "serve's HTTP port; the router's clients' ZeroMQ port (DESIGN.md)",
    "served_model_name": "serve's name for its model; the name the bench's requests send",
}
# the runtime's packages, where components receive groups
RUNTIME = ("client", "distributed", "engine", "executor", "mem_cache", "server")
# dataclasses that take two or more settings of one group as plain values, and why
TAKES_VALUES = {
    "AdmissionBudget": "the token arithmetic of two bounds, built by its tests without settings",
}


def _groups() -> set[type[Settings]]:
    return {g for command in COMMANDS for g in command.groups()}


def _declarations() -> Counter[str]:
    """How many groups declare each setting (a setting another's `shared` takes aside)."""
    return Counter(
        f.name
        for group in _groups()
        for f in dataclasses.fields(group)
        if "shares" not in f.metadata
    )


def test_each_setting_is_declared_once_in_one_group():
    twice = {name for name, n in _declarations().items() if n > 1}
    assert twice == set(SAME_NAME)
    for command in COMMANDS:
        command.sections()  # a TypeError when a field is no group's, or two groups'


def test_a_shared_setting_is_its_owners():
    """Same help (the bench may append why it sets its own default) and choices."""
    shared = [f for g in _groups() for f in dataclasses.fields(g) if "shares" in f.metadata]
    assert {f.name for f in shared} >= {"model", "dtype", "max_total_tokens", "tp_size"}
    for f in shared:
        owner = {o.name: o for o in dataclasses.fields(f.metadata["shares"])}[f.name]
        assert f.metadata["help"].startswith(owner.metadata["help"]), f.name
        assert f.metadata.get("choices") == owner.metadata.get("choices"), f.name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_setting_is_a_flag_a_keyword_and_a_documented_row(command):
    parser = argparse.ArgumentParser()
    command.add_cli_args(parser)
    names = {f.name for f in dataclasses.fields(command)}
    assert {a.dest for a in parser._actions} - {"help"} == names
    page = render()
    assert all(f"`--{name.replace('_', '-')}`" in page for name in names)


def test_every_serve_setting_is_an_engine_keyword():
    """`rt.Engine(**kwargs)` builds `ServerArgs.from_kwargs`: each setting by its name, and an
    unknown one refused by name."""
    defaults = ServerArgs()
    values = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(ServerArgs)}
    assert ServerArgs.from_kwargs(**values) == defaults
    assert ServerArgs.from_kwargs(page_size=4).page_size == 4
    with pytest.raises(TypeError, match="max_running_request"):
        ServerArgs.from_kwargs(max_running_request=1)


def _dataclass_fields(path: Path) -> dict[str, list[str]]:
    """Each @dataclass of a module: its annotated field names."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            found[node.name] = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    return found


def test_no_component_restates_a_group():
    """A runtime dataclass that takes settings takes their group (or a composition of
    groups): none declares two or more settings of one group again."""
    owner = {f.name: g for g in _groups() for f in dataclasses.fields(g)}
    restated = []
    for package in RUNTIME:
        for path in sorted((ROOT / "radixrt" / package).rglob("*.py")):
            for cls, fields in _dataclass_fields(path).items():
                groups = Counter(owner[f] for f in fields if f in owner)
                if any(n > 1 for n in groups.values()) and cls not in TAKES_VALUES:
                    restated.append(f"{path.relative_to(ROOT)}: {cls}")
    assert not restated, restated
