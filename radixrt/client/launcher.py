"""`rt.Runtime` and `rt.Engine`: start a runtime process and talk to it.

The scheduler always runs in a process of its own, on that process's main thread. That keeps
the forward loop off the caller's GIL and, on the CPU, gives it an OpenMP thread team of its own
(parallel regions started from a second thread of a process whose main thread already used
OpenMP run several times slower here: 0.1 ms instead of 0.02 ms for a small multiply).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any

import zmq

from radixrt.client.endpoint import ZmqEndpoint, load_tokenizer
from radixrt.client.transport import RuntimeClient
from radixrt.config import SECRETS, ServerArgs
from radixrt.lifecycle import PARENT_PID_ENV, python_command
from radixrt.protocol import UpdateWeightsFromTensor, tensor_handoff_dir

START_TIMEOUT_S = 600
LOG_TAIL_LINES = 30


class RuntimeStartError(RuntimeError):
    """The runtime process exited, or never became healthy, while starting."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Runtime(ZmqEndpoint):
    """Starts `radixrt serve` on free loopback ports (unless `port=` / `zmq_port=` are given),
    waits until it is healthy (and its HTTP API too, unless `disable_http=True`), and is a
    backend that speaks ZeroMQ to it: `.url` and `.zmq_url` are the ZeroMQ address,
    `.http_url` the HTTP API's base URL (`rt.RuntimeEndpoint(runtime.http_url)` speaks HTTP); `.shutdown()`, leaving a `with` block, interpreter exit or
    garbage collection stop the process. `timeout` bounds each wait for a reply (as on
    `RuntimeEndpoint`), `curve_client_secret_key` is this launcher's own CURVE key (needed when
    `curve_client_keys` lists who may connect); every other keyword is a server setting
    (`ServerArgs`)."""

    def __init__(
        self,
        model: str = "default",
        timeout: float | None = None,
        curve_client_secret_key: str | None = None,
        **server_args: Any,
    ):
        # with a key file, an admin key of the launcher's own where none is given: its own calls
        # (health, the tokenizer from model_info's path) then rest on no tenant's key
        self.args = ServerArgs.from_kwargs(model=model, **server_args).with_own_admin_key()
        self._tmp = Path(tempfile.mkdtemp(prefix="radixrt-"))
        self._configure_endpoint(given=set(server_args))
        self._log_path = self._tmp / "runtime.log"
        self._proc = self._launch()
        server_key = (
            zmq.curve_public(self.args.curve_secret_key.encode()).decode()
            if self.args.curve_secret_key
            else None
        )
        super().__init__(
            self.args.endpoint,
            api_key=self.args.api_key or self.args.admin_api_key,  # the admin's: the default tenant
            timeout=timeout,
            curve_server_key=server_key,
            admin_api_key=self.args.admin_api_key,
            curve_client_secret_key=curve_client_secret_key,
        )
        self._finalizer = weakref.finalize(self, _stop, self._proc, self.client, self._tmp)
        self._wait_ready()

    def _configure_endpoint(self, given: set[str]) -> None:
        """Free ports for the HTTP API and the ZeroMQ socket unless the caller chose them (a
        given `port` alone keeps the server's default ZeroMQ port, `port` + 1)."""
        if "port" not in given:
            self.args = dataclasses.replace(self.args, port=free_port())
        if "zmq_port" not in given and "port" not in given:
            self.args = dataclasses.replace(self.args, zmq_port=free_port())

    def _launch(self) -> subprocess.Popen[bytes]:
        with open(self._log_path, "wb") as log:
            return subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, env=self._env()
            )

    def _command(self) -> list[str]:
        return python_command("-m", "radixrt", "serve", *self.args.to_cli_args())

    def _env(self) -> dict[str, str]:
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}  # it ends when this process does
        for name, var in SECRETS.items():
            if getattr(self.args, name):
                env[var] = getattr(self.args, name)
        return env

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._finalizer()
                raise RuntimeStartError(
                    f"the runtime exited with code {self._proc.returncode} while starting; "
                    f"last log lines:\n{self.log_tail()}"
                )
            try:
                self.health(timeout=0.5)
            except TimeoutError:
                continue
            if self.http_url is None or _http_ok(f"{self.http_url}/health"):
                return
            time.sleep(0.1)
        self._finalizer()
        raise RuntimeStartError(
            f"the runtime did not become healthy within {START_TIMEOUT_S}s; "
            f"last log lines:\n{self.log_tail()}"
        )

    @property
    def http_url(self) -> str | None:
        """Base URL of the HTTP API (SGLang's native routes; the OpenAI API is under /v1), None
        with `disable_http`."""
        if self.args.disable_http:
            return None
        return f"http://{self.args.http_host}:{self.args.port}"

    @property
    def zmq_url(self) -> str:
        """The ZeroMQ address this backend speaks to (`tcp://host:zmq_port` or `ipc://path`)."""
        return self.args.endpoint

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(the runtime's log is gone)"

    @property
    def tokenizer(self) -> Any:
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_tokenizer(self.model_info)
        return self._tokenizer

    def shutdown(self) -> None:
        if self._finalizer.alive:
            try:
                if self._proc.poll() is None:  # not gone already (a drain after SIGTERM)
                    self.client.call("shutdown", timeout=30)
                self._proc.wait(timeout=30)
            except Exception:  # already gone, or stuck: the finalizer ends it
                pass
            self._finalizer()

    close = shutdown

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class Engine(Runtime):
    """The runtime for one program: a private ipc:// socket and no HTTP API, logs on this
    process's stderr."""

    def _configure_endpoint(self, given: set[str]) -> None:
        self.args = dataclasses.replace(
            self.args, host=f"ipc://{self._tmp / 'runtime.sock'}", disable_http=True
        )

    def _launch(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self._command(), env=self._env())

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "(see the runtime's log above)"

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]] | dict[str, Any],
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Serve these weights (every tensor of the model by its checkpoint name, as a
        `state_dict()` names them; on any device and dtype) once the requests in flight finish,
        as `update_weights_from_disk` does. They reach the runtime process as a safetensors
        file in shared memory (/dev/shm where there is one), never pickled, removed after."""
        from safetensors.torch import save_file  # torch only on this path

        folder = Path(tempfile.mkdtemp(prefix="radixrt-weights-", dir=tensor_handoff_dir()))
        try:
            save_file(_distinct(named_tensors), folder / "model.safetensors")
            op = UpdateWeightsFromTensor(str(folder), weight_version, abort_all_requests)
            result: dict[str, Any] = self.control(op)
            return result
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _distinct(named_tensors: list[tuple[str, Any]] | dict[str, Any]) -> dict[str, Any]:
    """Contiguous CPU copies by name, each storage once: a tied weight (lm_head sharing the
    embedding's storage) is left out, as save_pretrained leaves it, since safetensors refuses
    shared tensors."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    out, seen = {}, set()
    for name, tensor in items:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes], client: RuntimeClient, tmp: Path) -> None:
    client.close()
    if proc.poll() is None:
        proc.terminate()  # the runtime stops cleanly on SIGTERM
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    shutil.rmtree(tmp, ignore_errors=True)
