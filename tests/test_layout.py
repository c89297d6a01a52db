"""The package layout's contracts: imports run one way, the client side and the HTTP gateway
load no torch, and every sub-package ships in the wheel."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
    },
    "engine": {
        "mem_cache",
        "executor",
        "structured",
        "speculative",
        "protocol",
        "config",
        "sampling_params",
    },
    "mem_cache": set(),
    "executor": {"models", "attention", "mem_cache", "distributed", "config", "lifecycle"},
    "models": {"attention", "distributed", "kernels"},
    "distributed": set(),
    "attention": {"kernels"},
    "structured": set(),
    "speculative": set(),
    "kernels": set(),
    "frontend": {"client", "frontend", "structured"},  # structured.tools: calls, no torch
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


def _runtime_imports(path: Path) -> set[str]:
    """The radixrt sub-packages a module imports, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
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


@pytest.mark.parametrize(
    "modules",
    [
        "radixrt",  # the user API: DSL, endpoint, launchers
        "radixrt.server.http.process, radixrt.server.http.app",  # the HTTP gateway's process
    ],
)
def test_client_side_loads_no_torch(modules):
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules or 'radixrt.engine' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


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
