"""The package layout's contracts: imports run one way between packages, no module-level import
cycle between modules, the client side and the HTTP gateway load no torch, and every
sub-package ships in the wheel."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from radixrt.lifecycle import python_command

ROOT = Path(__file__).resolve().parent.parent
# package -> the radixrt packages it may import (at run time; type-checking-only imports aside)
ALLOWED = {
    "client": {"protocol", "config", "lifecycle"},
    "server": {
        "client",
        "engine",
        "structured",
        "protocol",
        "config",
        "sampling_params",
        "lifecycle",
        "logs",
        "multimodal",
    },
    "engine": {
        "mem_cache",
        "executor",
        "structured",
        "speculative",
        "protocol",
        "config",
        "sampling_params",
        "forward_batch",
        "multimodal",
    },
    # the cache settings; the C writer of quantized KV rows; the KV events' throttled warnings
    "mem_cache": {"config", "kernels", "logs"},
    "executor": {
        "models",
        "attention",
        "mem_cache",
        "distributed",
        "config",
        "lifecycle",
        "forward_batch",
        "kernels",  # gguf_weights: GGUF blocks copied into int4_gemm's packed layout
        "multimodal",
    },
    "models": {"attention", "distributed", "kernels", "forward_batch"},
    "distributed": {"forward_batch"},  # the commands rank 0 sends carry a step's batch
    "attention": {"kernels", "forward_batch"},
    # kernels: bitmask, the C pass that applies masks to CPU logits; protocol: nesting_depth
    "structured": {"kernels", "protocol"},
    "speculative": set(),
    # images: the image settings and the refusals' codes; processors: numpy and Pillow only
    "multimodal": {"config", "protocol"},
    "kernels": set(),
    "frontend": {"client", "frontend", "structured"},  # structured.tools: calls, no torch
    # Ray Serve: rt.Engine in each replica, the gateway's handlers, the router's policy and trees
    "integrations": {"client", "server", "config", "protocol"},
}
NOT_SOURCES = (
    ".git",
    ".venv",
    "build",
    "*.egg-info",
    "bench_results",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)
SOURCE_DIRS = {"frontend": ROOT / "frontend", "kernels": ROOT / "kernels"}


def _package_dir(name: str) -> Path:
    return SOURCE_DIRS.get(name, ROOT / "radixrt" / name)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"


def _runtime_imports(path: Path) -> set[str]:
    """The radixrt sub-packages a module imports, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if _is_type_checking(node) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module
            else []
        )
        for name in names:
            parts = name.split(".")
            if parts[0] == "radixrt" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package):
    for path in sorted(_package_dir(package).rglob("*.py")):
        wrong = _runtime_imports(path) - ALLOWED[package] - {package}
        assert not wrong, f"{path.relative_to(ROOT)} imports radixrt.{sorted(wrong)}"


def _modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (frontend/ and kernels/
    install as radixrt.frontend and radixrt.kernels); a package by its __init__.py."""
    found = {}
    for top, base in [("radixrt", ROOT / "radixrt"), *SOURCE_DIRS.items()]:
        prefix = ["radixrt"] if top != "radixrt" else []
        for path in base.rglob("*.py"):
            parts = [*prefix, top, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _statements(body: list[ast.stmt], deferred: bool) -> list[ast.stmt]:
    """The statements that run when a module is imported: not `if TYPE_CHECKING:` (its else
    does run), and function bodies only when `deferred`; class bodies, other ifs and try
    blocks do."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        if _is_type_checking(node):
            out += _statements(node.orelse, deferred)
            continue
        out.append(node)
        for name in ("body", "orelse", "finalbody"):
            out += _statements(getattr(node, name, []), deferred)
        for handler in getattr(node, "handlers", []):
            out += _statements(handler.body, deferred)
    return out


def _imported_modules(
    name: str, path: Path, modules: dict[str, Path], deferred: bool = False
) -> set[str]:
    """The modules of `modules` that importing `name` imports first (`from a import b` imports
    a, and a.b too when that is a module); with `deferred`, those its functions import too. A
    package's parents are left out: Python imports them before any of their modules, so every
    module would otherwise close a loop."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _statements(ast.parse(path.read_text()).body, deferred):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_no_module_level_import_cycle():
    """A module-level cycle makes import order matter (a half-initialised module, an
    ImportError at a distance). Imports inside functions and for type checking do not count."""
    modules = _modules()
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    assert "radixrt.executor.model_runner" in graph["radixrt.executor.tp_worker"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_even_through_imports_inside_functions():
    """A lazy import that closes a loop hides the same tangle from the test above: two modules
    that each need the other are one module, or share a third below them."""
    modules = _modules()
    graph = {
        name: _imported_modules(name, path, modules, deferred=True)
        for name, path in modules.items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (through a function-level import): " + " -> ".join(cycle)


def test_executor_modules_import_one_way_even_when_deferred():
    """tp_worker -> model_runner -> cuda_graph_runner: the runner knows nothing of ranks, and
    the graph runner gets what it uses, not the runner (no import goes back up the chain,
    not even inside a function)."""
    modules = _modules()
    executor = {n: p for n, p in modules.items() if n.startswith("radixrt.executor.")}
    graph = {n: _imported_modules(n, p, executor, deferred=True) for n, p in executor.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_and_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "statement",
    [
        "import radixrt",  # the user API: DSL, endpoint, launchers
        "import radixrt.server.http.process, radixrt.server.http.app",  # the HTTP gateway's process
        "import radixrt.server.launch",  # serve's process while its gateway child starts
        "import radixrt.cli; radixrt.cli.build_parser()",  # every `radixrt` command, the gateway's
    ],
)
def test_client_side_loads_no_torch(statement):
    code = f"import sys; {statement}; sys.exit('torch' in sys.modules or 'radixrt.engine' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P (no working directory) is 3.11's")
def test_processes_started_in_the_checkout_import_hugging_faces_kernels():
    """radixrt starts Python (`serve`'s gateway, launchers' runtimes) without the working directory
    on sys.path: in the checkout, kernels/ would take the name of Hugging Face's `kernels`, which
    transformers imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import kernels; print(kernels.__file__)"
    out = subprocess.run(
        python_command("-c", code), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "site-packages" in out.stdout, out


def test_python_started_in_the_checkouts_root_imports_hugging_faces_kernels():
    """A user's `python -m radixrt ...` in the clone's root (no -P, no PYTHONSAFEPATH): importing
    radixrt drops the root from sys.path, so transformers finds Hugging Face's `kernels`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import radixrt, kernels; print(kernels.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "site-packages" in out.stdout, out


def test_wheel_holds_every_sub_package(tmp_path):
    """Built from a copy of the sources (no stale build/ folder can add or hide a file)."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*command, "-w", str(tmp_path), str(source)], check=True, timeout=300, capture_output=True
    )
    names = zipfile.ZipFile(next(tmp_path.glob("radixrt-*.whl"))).namelist()
    packages = {p.parent.relative_to(ROOT) for p in (ROOT / "radixrt").rglob("__init__.py")}
    for top in ("frontend", "kernels"):
        packages |= {
            Path("radixrt") / p.parent.relative_to(ROOT) for p in (ROOT / top).rglob("__init__.py")
        }
    shipped = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    assert {str(p) for p in packages} == shipped


# each HTTP API's routes come from the module named after it (server/http/), over the shared
# Gateway; the app module serves only what belongs to no API
ROUTE_MODULES = {
    "/v1/completions": "openai_chat",
    "/v1/chat/completions": "openai_chat",
    "/v1/responses": "openai_responses",
    "/v1/embeddings": "openai_embeddings",
    "/v1/messages": "anthropic_messages",
    "/v1/models": "gateway",
    "/health": "gateway",
    "/metrics": "gateway",
}


def test_each_http_api_is_one_module():
    """Every route's handler lives in its API's module: OpenAI's and Anthropic's by path, the
    control ops' where their records say (`control`), the rest SGLang's native routes."""
    from fastapi.routing import APIRoute

    from radixrt.protocol import CONTROL_OPS
    from radixrt.server.http.app import build_app
    from radixrt.server.http.gateway import Gateway

    app = build_app(Gateway(endpoint=None))  # type: ignore[arg-type]  # routes only, never run
    control = {f"/{r.op}" for r in CONTROL_OPS.values() if r.route is not None}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        path = route.path.split("/{")[0]
        if path in control:
            want = "control"
        else:
            prefix = next((p for p in ROUTE_MODULES if path == p or path.startswith(p + "/")), None)
            want = ROUTE_MODULES[prefix] if prefix else "sglang_native"
        module = route.endpoint.__module__.rpartition(".")[2]
        assert module == want, f"{route.path} is served from {module}, not {want}"
