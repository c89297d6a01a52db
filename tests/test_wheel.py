"""The built wheel, installed into a fresh virtualenv, serves: `radixrt serve --model default`
answers a completion. No network: the wheel is built without build isolation, installed with
`--no-deps --no-index`, and finds its dependencies in this environment's site-packages (a `.pth`
line in the new venv, after its own site-packages, so the wheel's radixrt is the one imported)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from radixrt.client.launcher import free_port

from timeouts import REPLY_TIMEOUT_S

pytestmark = [pytest.mark.wheel, pytest.mark.model]

ROOT = Path(__file__).parents[1]
START_TIMEOUT_S = 300.0  # a model load on a busy 2-core machine
# What a CPU-only server imports; none may pull in triton (the [gpu] extra).
CPU_MODULES = (
    "radixrt",
    "radixrt.server.zmq_server",
    "radixrt.server.http.app",
    "radixrt.engine.scheduler",
    "radixrt.models.decoder",
    "radixrt.attention.torch_backend",
)


def _source_copy(dest: Path) -> Path:
    """The files a checkout holds (tracked, and new ones not ignored), without build output."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout to know the source files")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _venv_with_wheel(tmp: Path) -> Path:
    """A fresh venv holding only the built wheel; this environment's packages after it."""
    pytest.importorskip("setuptools", minversion="77", reason="builds without isolation (offline)")
    src = _source_copy(tmp / "src")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src],
                   check=True, cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("radixrt-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel],
                   check=True)  # fmt: skip
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "radixrt serve exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:  # refused, reset or timed out while it starts
            time.sleep(0.5)
    raise AssertionError("radixrt serve did not become healthy")


def test_the_wheel_installs_and_serves_the_default_model(tmp_path):
    venv = _venv_with_wheel(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [venv / "bin" / "radixrt", "serve", "--model", "default", "--port", str(port),
         "--max-total-tokens", "2048", "--log-level", "warning"],
        cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # while it loads: the wheel's radixrt is the one imported, and a CPU server's modules
        # import without triton
        check = f"import sys, {', '.join(CPU_MODULES)}; print(radixrt.__file__, 'triton' in sys.modules)"
        where, triton = subprocess.run(
            [venv / "bin" / "python", "-c", check],
            capture_output=True, text=True, check=True, cwd=tmp_path,
        ).stdout.split()  # fmt: skip
        assert where.startswith(str(venv)) and triton == "False", (where, triton)
        _wait_healthy(url, proc)
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as reply:
            answer = json.load(reply)
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)
