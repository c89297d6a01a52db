"""`TemplatePool`: the HTTP gateway's chat templates, rendered in worker processes that are killed
and replaced when a render overruns `--chat-template-timeout`.

A chat template is code from a model file or `--chat-template` that runs on each request's
messages, and a template can loop for hours or build gigabytes when a message holds the right
word. A thread that runs one cannot be stopped: five such requests held the gateway's threads for
good and the chat routes stopped answering. Here each render runs in a child process
(`radixrt/client/chat_render.py` run as a script: jinja2's sandbox with transformers' helpers and
bounds on what a template may build, under an address-space limit), which is killed when its
render passes the timeout; the request gets `400 invalid_request` naming the limit, and a fresh
process takes the dead one's place. The output is bounded by `--max-prompt-bytes` in the worker,
as it is made.

One process starts with the gateway's model (when it has a template), so an ordinary chat's
render costs a round trip to a warm process (about a millisecond beside the render itself);
more start as renders overlap, up to `workers` (`--http-cpu-threads`), and stay. Each is about
24 MB resident, which a server that never overlaps renders does not hold. Each is driven by one
thread of the pool's own, which sends a job, waits for the answer at most the timeout, and kills
on overrun; the event loop only awaits that thread.

Tenants share the workers as they share the CPU pool's threads (`cpu_pool.py`): one tenant's
renders run at most `per_tenant` at once (half the workers), so one tenant's slow templates
leave the other half to everyone else; a render that has its tenant's turn waits at most
`wait_s` for a worker, then gets 'overloaded'. A tenant with MAX_WAITING_PER_TENANT renders
waiting gets 'rate_limited'; past MAX_WAITING in all, everyone's next one gets 'overloaded'.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from radixrt.client import chat_render
from radixrt.protocol import ErrorCode
from radixrt.server.http.cpu_pool import CALLER, WaitingLine, overloaded
from radixrt.server.http.errors import APIError

logger = logging.getLogger(__name__)

WORKER_START_S = 10.0  # a worker's start (its imports) is not held against a render
MAX_WAITING_PER_TENANT = 256
MAX_WAITING = 1024
BASE_MEMORY_BYTES = 512 << 20  # a worker's address space beside what its jobs need


def worker_memory_bytes(max_frame_bytes: int, max_prompt_bytes: int) -> int:
    """A worker's address-space limit: room for the largest job (a body of `max_frame_bytes`,
    parsed) and the largest output (`max_prompt_bytes`, as text and as UTF-8) many times over."""
    return BASE_MEMORY_BYTES + 16 * max(max_frame_bytes, max_prompt_bytes)


def invalid(message: str) -> APIError:
    return APIError(400, message, param="messages", code=ErrorCode.INVALID_REQUEST.value)


class RenderWorker:
    """One render process and its socket."""

    def __init__(self, memory_bytes: int):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-I",  # no PYTHONPATH, no current directory: the standard library and jinja2
                str(Path(chat_render.__file__)),
                str(theirs.fileno()),
                str(memory_bytes),
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            try:
                self.ready = self.conn.poll(WORKER_START_S) and self.conn.recv_bytes() == (
                    chat_render.READY
                )
            except (EOFError, OSError):
                return False
        return self.ready

    def stop(self) -> None:
        """Kill the process and wait for it, so no zombie stays behind."""
        self.conn.close()
        self.process.kill()
        self.process.wait()


class TemplatePool:
    """Render processes for the gateway's chat templates (see the module docstring). Its
    semaphores are made on first use, inside the event loop that then is their one user."""

    def __init__(self, workers: int, timeout_s: float, memory_bytes: int):
        self.workers = workers
        self.timeout_s = timeout_s
        self.wait_s = max(timeout_s, 1.0)
        self.memory_bytes = memory_bytes
        # one thread per worker: a thread holds one worker while it drives a render
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="gateway-template")
        self._idle: list[RenderWorker] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self.waiting = WaitingLine("chat-template renders", MAX_WAITING_PER_TENANT, MAX_WAITING)
        self._shared: asyncio.Semaphore | None = None
        self._own: dict[str, asyncio.Semaphore] = {}
        self.renders = 0
        self.killed = 0

    @property
    def per_tenant(self) -> int:
        return max(1, self.workers // 2)

    def start(self) -> None:
        """Start one worker (once), from a thread of the pool, which lives as long as the pool
        (a worker dies with the thread that started it: PR_SET_PDEATHSIG); `_take` starts the
        others as renders overlap."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        self.executor.submit(self._warm_one)

    def _warm_one(self) -> None:
        worker = RenderWorker(self.memory_bytes)
        worker.wait_ready()
        self._give_back(worker)

    async def render(self, job: bytes) -> str:
        """The prompt that the job (`chat_render.RenderJob.to_json`) renders to, in a worker, for
        the current `CALLER`'s tenant. 400 `invalid_request` when the template fails, passes a
        bound, or overruns the timeout; 429/503 when too many renders wait."""
        self.start()
        tenant = CALLER.get().tenant
        self.waiting.join(tenant)
        own = self._own.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        self._shared = shared = self._shared or asyncio.Semaphore(self.workers)
        try:
            await own.acquire()
        finally:
            self.waiting.leave(tenant)
        try:
            await asyncio.wait_for(shared.acquire(), self.wait_s)
        except (TimeoutError, asyncio.TimeoutError):
            own.release()
            raise overloaded(
                f"every chat-template worker stayed busy for {self.wait_s:g} s"
            ) from None
        except BaseException:
            own.release()
            raise
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self.executor, self._exchange, job)

        def release(future: asyncio.Future[str]) -> None:
            shared.release()
            own.release()
            if not future.cancelled():
                future.exception()  # retrieved: a request cancelled meanwhile does not read it

        # the turns end when the worker is free again, even if this request is cancelled first
        done.add_done_callback(release)
        return await asyncio.shield(done)

    # ---- on the pool's threads ----------------------------------------------------------------
    def _take(self) -> RenderWorker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return RenderWorker(self.memory_bytes)

    def _give_back(self, worker: RenderWorker, starting: bool = False) -> None:
        """`worker` idle again; one still `starting` is taken after the ready ones."""
        with self._lock:
            if not self._closed and len(self._idle) < self.workers:
                self._idle.insert(0, worker) if starting else self._idle.append(worker)
                return
        worker.stop()

    def _replace(self, worker: RenderWorker) -> None:
        worker.stop()
        self._give_back(RenderWorker(self.memory_bytes), starting=True)

    def _exchange(self, job: bytes) -> str:
        """Send the job to a worker and wait for its answer at most the timeout; kill the
        worker past it (or when it died: its memory limit) and put a fresh one in its place."""
        worker = self._take()
        if not worker.wait_ready() or not self._send(worker, job):
            # a worker that did not start, or died idle: one more try with a fresh one
            self._replace(worker)
            worker = self._take()
            if not worker.wait_ready() or not self._send(worker, job):
                self._replace(worker)
                raise overloaded("the chat-template worker did not start")
        started = time.monotonic()
        with self._lock:
            self.renders += 1
        try:
            answered = worker.conn.poll(self.timeout_s)
            reply = worker.conn.recv_bytes() if answered else None
        except (EOFError, OSError):
            self._replace(worker)
            self._count_kill()
            raise invalid(
                "the chat template's render stopped: it ran out of memory (its render process "
                f"may use {self.memory_bytes >> 20} MiB)"
            ) from None
        if reply is None:
            self._replace(worker)
            self._count_kill()
            ran = time.monotonic() - started
            logger.warning("killed a chat-template render after %.1f s", ran)
            raise invalid(
                f"the chat template did not finish rendering within {self.timeout_s:g} s "
                "(--chat-template-timeout); it was stopped"
            )
        self._give_back(worker)
        verdict, data = reply[:1], reply[1:]
        if verdict == chat_render.OK:
            return data.decode()
        body = data.decode(errors="replace")
        if verdict == chat_render.LIMIT:
            raise invalid(body)
        raise invalid(f"cannot render the messages with the chat template: {body}")

    def _count_kill(self) -> None:
        with self._lock:
            self.killed += 1

    @staticmethod
    def _send(worker: RenderWorker, job: bytes) -> bool:
        try:
            worker.conn.send_bytes(job)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Stop every worker (a render in flight ends with its worker)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
