"""The container, cluster and service files name only flags that exist: each `radixrt SUB ...`
they run (a Dockerfile's ENTRYPOINT + CMD and RUN lines, a Kubernetes container's or a compose
service's command and args, a systemd ExecStart) parses with the real command line, and each of
its flags is in `radixrt SUB --help`. Model-free."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from radixrt.cli import build_parser

ROOT = Path(__file__).parents[1]
SUBCOMMANDS = {"serve", "router", "prepare-model", "generate", "bench"}
SHELL_BREAKS = {";", "&&", "||", "|"}
RUNNERS = {
    "Dockerfile",
    "Dockerfile.cuda",
    "deploy/compose/compose.yaml",
    "deploy/k8s/worker.yaml",
    "deploy/k8s/router.yaml",
    "deploy/inference-gateway/pool.yaml",
    "deploy/k8s-multinode/lws-tp.yaml",
    "radixrt.service",
}


@dataclass(frozen=True)
class Invocation:
    """One `radixrt` command line found in a deploy file."""

    source: str
    argv: tuple[str, ...]  # after `radixrt`: the subcommand, then its arguments

    @property
    def flags(self) -> list[str]:
        return [a.split("=")[0] for a in self.argv if a.startswith("--")]


def deploy_files() -> list[Path]:
    files = [ROOT / "Dockerfile", ROOT / "Dockerfile.cuda"]
    files += [
        p for p in sorted((ROOT / "deploy").rglob("*")) if p.suffix in (".yaml", ".yml", ".service")
    ]
    return files


def radixrt_commands(words: list[str], source: str) -> Iterator[Invocation]:
    """Each `radixrt SUB args...` in a list of shell words (shell strings split first), up to a
    shell separator."""
    words = [w for arg in words for w in shlex.split(arg)]
    for i, word in enumerate(words[:-1]):
        if Path(word).name == "radixrt" and words[i + 1] in SUBCOMMANDS:
            argv = []
            for w in words[i + 1 :]:
                if w in SHELL_BREAKS:
                    break
                argv.append(w.removesuffix(";"))
                if w.endswith(";"):
                    break
            yield Invocation(source, tuple(argv))


def _as_list(value: object) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value or []]


def _yaml_commands(path: Path) -> Iterator[Invocation]:
    """Containers (Kubernetes) and services (compose): command/entrypoint then args; an image
    whose ENTRYPOINT is radixrt (ours) runs its args as radixrt's."""

    def walk(node: object) -> Iterator[dict]:
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for doc in yaml.safe_load_all(path.read_text()):
        for node in walk(doc):
            if not ({"args", "command", "entrypoint"} & set(node)):
                continue
            head = _as_list(node.get("entrypoint")) + _as_list(node.get("command"))
            args = _as_list(node.get("args"))
            if not head and str(node.get("image", "")).startswith("radixrt"):
                head = ["radixrt"]
            yield from radixrt_commands(head + args, str(path.relative_to(ROOT)))


def _dockerfile_commands(path: Path) -> Iterator[Invocation]:
    text = path.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    exec_form = {}
    source = str(path.relative_to(ROOT))
    for line in lines:
        instruction, _, rest = line.partition(" ")
        if instruction in ("ENTRYPOINT", "CMD"):
            exec_form[instruction] = json.loads(rest)
        elif instruction == "RUN":
            yield from radixrt_commands([rest], source)
    yield from radixrt_commands(exec_form["ENTRYPOINT"] + exec_form["CMD"], source)


def _unit_commands(path: Path) -> Iterator[Invocation]:
    for line in path.read_text().splitlines():
        if line.startswith("ExecStart="):
            yield from radixrt_commands([line.removeprefix("ExecStart=")], str(path.name))


def invocations() -> list[Invocation]:
    found: list[Invocation] = []
    for path in deploy_files():
        if path.suffix in (".yaml", ".yml"):
            found += _yaml_commands(path)
        elif path.suffix == ".service":
            found += _unit_commands(path)
        else:
            found += _dockerfile_commands(path)
    return found


def help_text(subcommand: str) -> str:
    """What `radixrt SUB --help` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([subcommand, "--help"])
    return out.getvalue()


def test_the_files_that_run_radixrt_are_all_read():
    """The extraction finds a command in each file that runs radixrt (else it checks nothing)."""
    sources = {i.source for i in invocations()}
    assert RUNNERS <= sources, RUNNERS - sources


@pytest.mark.parametrize("invocation", invocations(), ids=lambda i: f"{i.source}:{i.argv[0]}")
def test_flags_exist_and_parse(invocation):
    subcommand = invocation.argv[0]
    helps = help_text(subcommand)
    missing = [f for f in invocation.flags if f not in helps]
    assert not missing, f"{invocation.source}: not in `radixrt {subcommand} --help`: {missing}"
    build_parser().parse_args(list(invocation.argv))  # values of the right type and choice


def test_the_inference_pool_publishes_kv_events_the_picker_reads():
    """The pool's `--kv-events-config` is a valid config that connects to the picker's KV-event
    socket with llm-d's topic, and its page size and hash seed are the picker's block size
    and hash seed."""
    from radixrt.mem_cache.kv_events import KVEventsConfig, binds

    folder = ROOT / "deploy/inference-gateway"
    pool = next(yaml.safe_load_all((folder / "pool.yaml").read_text()))
    container = pool["spec"]["template"]["spec"]["containers"][0]
    args, env = container["args"], {e["name"]: e.get("value") for e in container["env"]}
    config = KVEventsConfig.from_json(args[args.index("--kv-events-config") + 1])
    assert config.enabled and not binds(config.endpoint) and config.topic.startswith("kv@")
    picker = yaml.safe_load(
        next(yaml.safe_load_all((folder / "epp.yaml").read_text()))["data"]["epp.yaml"]
    )
    scorer = next(p for p in picker["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    tokens = scorer["parameters"]["indexerConfig"]["tokenProcessorConfig"]
    assert tokens["blockSize"] == int(args[args.index("--page-size") + 1])
    assert tokens["hashSeed"] == env["PYTHONHASHSEED"]
    assert scorer["parameters"]["kvEventsConfig"]["zmqEndpoint"].endswith(
        ":" + config.endpoint.rpartition(":")[2]
    )


def test_the_leader_worker_set_is_one_tensor_parallel_group_over_its_pods():
    """Leader and worker run the same model and TP shape, one node rank each (0 the leader),
    over as many nodes as the group has pods, meeting at the leader's address."""
    lws = next(yaml.safe_load_all((ROOT / "deploy/k8s-multinode/lws-tp.yaml").read_text()))
    spec = lws["spec"]["leaderWorkerTemplate"]
    parser = build_parser()
    args = [
        parser.parse_args(spec[t]["spec"]["containers"][0]["args"])
        for t in ("leaderTemplate", "workerTemplate")
    ]
    assert [a.node_rank for a in args] == list(range(spec["size"]))
    for a in args:
        assert (a.model, a.tp_size, a.nnodes) == (args[0].model, 2, spec["size"])
        assert a.dist_init_addr == "$(LWS_LEADER_ADDRESS):29500"
