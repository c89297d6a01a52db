"""Constraints (regex, JSON schema, choices, dtype) compiled to `grammar.Grammar`s: checked up
front, built in worker processes that are killed when they overrun their time budget, cached (LRU)
and shared by concurrent requests for the same constraint.

Why processes: an outlines-core build cannot be interrupted, and the expensive ones (a JSON
string with `maxLength: 200` inside an object: seconds and hundreds of MB) would keep a thread
busy long after its request gave up. A child process (`compile_worker.py`) can be killed, runs
under an address-space limit (outlines-core itself offers no limit on states or memory), and
dies with its parent. The Index comes back in outlines-core's own binary form
(`Index.from_binary`): nothing is unpickled by the runtime, and an Index whose binary form is
larger than MAX_INDEX_BYTES is refused in the child (that size is also what the parent would
spend decoding it and holding it in the cache).

Scheduling, so that a cheap constraint never waits behind expensive ones and every constraint
is answered in bounded time:
- the cache is keyed by the constraint as the request gave it (its kind and text, or JSON), and
  by tenant (no tenant learns from a compile's speed what another asked for): a repeat,
  another sample of an `n > 1` request included, is answered from it at once, verdicts
  included (a constraint that timed out fails fast), before anything is translated;
- a tenant with `compiles_per_tenant` expensive constraints in flight (queued or compiling in
  the slow lane or on the llguidance thread) has a new one refused at once (`CompilerBusy`, the
  request's `overloaded`), so no such queue grows past tenants x cap;
- every constraint is first checked in the caller's process, cheaply and without recursion past
  a bound (types, nesting, sizes: `regexes.load_schema`, `check_schema`, `check_regex`), and a
  JSON schema's `$ref` expansion against a budget (`regexes.check_expansion`, which stops the
  moment the budget is spent); its translation to a regex runs in the worker, where it can be
  killed;
- a *fast lane* (one worker) takes constraints that look cheap (short, no counted repetition
  past FAST_MAX_REPEAT) with a budget of FAST_BUDGET_S; one that overruns it is killed there
  and moves to the slow lane with what is left of its budget, so a misjudged one costs the fast
  lane at most FAST_BUDGET_S;
- a *slow lane* (SLOW_WORKERS workers) takes the rest with the full budget,
  `--constraint-compile-timeout` in all; at most COMPILES_PER_TENANT of one tenant's compiles run
  at once, and tenants take turns, so one tenant's expensive schemas hold one worker while
  other tenants use the other;
- a job waits for a worker at most `wait_s` (the compile timeout, or WORKER_START_S if longer:
  a worker's start is not held against it), then fails with `CompilerBusy`, uncached; so each
  constraint is answered within `wait_s` plus the compile timeout of being asked.
The scheduler drives the lanes through `poll()` (from its admission loop and its idle tick),
which reads replies, kills overruns, starts queued jobs, and stops workers idle for IDLE_EXIT_S;
`close()` kills every worker.

Constraints for llguidance (`ebnf` and `lark` always, JSON schemas with keywords only llguidance
enforces, such as numeric bounds; every kind with `--grammar-backend llguidance`) skip the lanes:
their translations and builds take milliseconds and are bounded by explicit `LLParserLimits`
(`llguidance_backend.py`: past them a build stops itself with an error), so one thread builds
them in turn; `poll()` collects them, and a build unfinished at its deadline fails its job (the
thread ends within those limits).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from outlines_core import Index

from radixrt.protocol import nesting_depth
from radixrt.structured import compile_worker as wire
from radixrt.structured.grammar import (
    CONSTRAINT_KINDS,
    DEFAULT_GRAMMAR_BACKEND,
    CompilerBusy,
    ConstraintError,
    Grammar,
    backend_for,
)
from radixrt.structured.guide import OutlinesGrammar
from radixrt.structured.regexes import (
    DTYPE_REGEXES,
    JSON_WHITESPACE,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_DEPTH,
    check_expansion,
    check_regex,
    check_schema,
    load_schema,
    needs_grammar,
    schema_nodes,
)
from radixrt.structured.vocabulary import TokenTable, build_vocabulary

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerBase

    from radixrt.structured import llguidance_backend as llg

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
FAST_BUDGET_S = 0.5  # a fast-lane job's time before it is moved to the slow lane
FAST_MAX_REPEAT = 16  # a counted repetition `{m,n}` past this sends a constraint to the slow lane
FAST_MAX_CHARS = 4096
SLOW_WORKERS = 2
COMPILES_PER_TENANT = 1  # of one tenant's slow-lane compiles, how many run at once
DEFAULT_COMPILES_PER_TENANT = 8  # of one tenant's expensive constraints, how many may be in flight
WORKER_START_S = 1.0  # the least time a job may wait for a worker (one may have to start)
IDLE_EXIT_S = 2.0  # a worker with nothing to do this long is stopped
WORKER_MEMORY_BYTES = 3 << 30  # each worker's address space (RLIMIT_AS)
MAX_INDEX_BYTES = 64 << 20  # an Index's binary form
MAX_CACHE_BYTES = 512 << 20  # of the Indexes the cache holds, by their binary form
MAX_CHOICES = 1024
# A cache key's text (the constraint as given, or its JSON): past any constraint the checks accept
MAX_KEY_CHARS = 2 * MAX_REGEX_CHARS
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass(eq=False)
class CompileJob:
    """One constraint's build, shared by every request (of one tenant) that asks for it: queued,
    then running in a worker, then done with a `grammar` or an `error` (which `result()`
    raises). `pattern` is what its builder reads: a regex, a JSON schema's text (outlines), or
    the constraint as given (llguidance, which translates it on its thread)."""

    kind: str
    pattern: str
    tenant: str
    budget_s: float  # run time left before the verdict is "too complex"
    wait_until: float = 0.0  # when a job still queued fails with CompilerBusy (monotonic)
    grammar: Grammar | None = None
    grammar_bytes: int = 0  # what the cache holds of it (an Index's binary form)
    error: ConstraintError | None = None

    @property
    def done(self) -> bool:
        return self.grammar is not None or self.error is not None

    def result(self) -> Grammar:
        if self.error is not None:
            raise self.error
        assert self.grammar is not None, "the compile has not finished"
        return self.grammar

    def fail(self, message: str) -> None:
        self.error = ConstraintError(message)

    def fail_busy(self, message: str) -> None:
        self.error = CompilerBusy(message)


@dataclass(frozen=True)
class CompileStats:
    """What the compiler has done since it started (`Scheduler.stats()["constraint_compiles"]`)."""

    started: int = 0
    finished: int = 0
    killed: int = 0  # overran a budget (fast-lane moves included) or died
    refused: int = 0  # CompilerBusy: a tenant past its cap, or a job that waited past its time
    longest_s: float = 0.0  # the longest single run in a worker
    workers: int = 0  # alive now


class Worker:
    """One compile child process, its socket, and the job it runs."""

    def __init__(self, vocabulary_file: int, whitespace: str):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-I",  # no PYTHONPATH, no current directory: only the venv's outlines-core
                str(Path(wire.__file__)),
                str(theirs.fileno()),
                str(vocabulary_file),
                str(WORKER_MEMORY_BYTES),
                str(MAX_INDEX_BYTES),
                str(MAX_REGEX_CHARS),
                whitespace,
            ],
            pass_fds=(theirs.fileno(), vocabulary_file),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        self.job: CompileJob | None = None
        self.started = time.monotonic()  # of the current job, or idle since
        self.deadline = 0.0

    def start(self, job: CompileJob, budget_s: float) -> None:
        self.job, self.started, self.deadline = job, time.monotonic(), time.monotonic() + budget_s
        flag = {"regex": wire.CHECK_SYNTAX, "json_schema": wire.BUILD_SCHEMA}.get(
            job.kind, wire.BUILD
        )
        self.conn.send_bytes(flag + job.pattern.encode())

    def finish(self) -> tuple[CompileJob, float]:
        """The job this worker ran and how long it ran; the worker is idle again."""
        job, ran = self.job, time.monotonic() - self.started
        assert job is not None
        job.budget_s -= ran
        self.job, self.started = None, time.monotonic()
        return job, ran

    def stop(self) -> None:
        """Kill the process and wait for it, so no zombie stays behind."""
        self.conn.close()
        self.process.kill()
        self.process.wait()


@dataclass(eq=False)
class Lane:
    """Workers that take queued jobs, tenants in turn, each tenant at most `per_tenant` at once;
    a job runs at most `budget_s` here (and never past its own budget left)."""

    name: str
    size: int
    budget_s: float
    per_tenant: int
    workers: list[Worker] = field(default_factory=list)
    queues: OrderedDict[str, deque[CompileJob]] = field(default_factory=OrderedDict)

    def push(self, job: CompileJob) -> None:
        self.queues.setdefault(job.tenant, deque()).append(job)

    def running(self, tenant: str) -> int:
        return sum(1 for w in self.workers if w.job is not None and w.job.tenant == tenant)

    def next_tenant(self) -> str | None:
        """The first tenant in turn with a queued job and fewer than `per_tenant` running."""
        return next((t for t in self.queues if self.running(t) < self.per_tenant), None)

    def pop(self, tenant: str) -> CompileJob:
        """The tenant's oldest queued job; the tenant then takes its turn last."""
        queue = self.queues.pop(tenant)
        job = queue.popleft()
        if queue:
            self.queues[tenant] = queue
        return job

    def in_flight(self, tenant: str) -> int:
        """The tenant's jobs queued or running here."""
        return len(self.queues.get(tenant, ())) + self.running(tenant)

    def expired(self, now: float) -> list[CompileJob]:
        """Take out and return the queued jobs whose wait ended before `now`."""
        gone = [j for queue in self.queues.values() for j in queue if j.wait_until < now]
        for tenant in list(self.queues):
            queue = deque(j for j in self.queues[tenant] if j.wait_until >= now)
            if queue:
                self.queues[tenant] = queue
            else:
                del self.queues[tenant]
        return gone


class ConstraintCompiler:
    """Compiles constraints to Grammars for one tokenizer (see the module docstring), with
    `backend` ("outlines" or "llguidance") for the regular kinds.

    Regexes use the Rust regex dialect (no lookaround, no backreferences) and must match the
    whole output. JSON schemas allow no whitespace between tokens (compact JSON). `ebnf` is
    GBNF (llama.cpp's dialect), `lark` llguidance's Lark.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        cache_size: int = 64,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        whitespace_pattern: str = JSON_WHITESPACE,
        backend: str = DEFAULT_GRAMMAR_BACKEND,
        compiles_per_tenant: int = DEFAULT_COMPILES_PER_TENANT,
    ):
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}"
            )
        if not compile_timeout_s > 0:
            raise ValueError("the constraint compile timeout must be > 0 seconds")
        if compiles_per_tenant < 1:
            raise ValueError("compiles_per_tenant must be >= 1")
        backend_for("regex", backend)  # raises for an unknown backend
        self.backend = backend
        self.hf_tokenizer = tokenizer
        self.tokens = TokenTable(tokenizer, vocab_size)
        self.vocabulary = build_vocabulary(tokenizer, self.tokens.mapping)
        self.eos_token_id: int = self.vocabulary.get_eos_token_id()
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.wait_s = max(compile_timeout_s, WORKER_START_S)
        self.compiles_per_tenant = compiles_per_tenant
        self.whitespace_pattern = whitespace_pattern
        # Jobs finished or in flight, so concurrent requests for one constraint share one build:
        # keyed by (tenant, kind, the constraint's text as given or its JSON), before any
        # translation; the backend is this compiler's and follows from the constraint.
        self._cache: OrderedDict[tuple[str, str, str], CompileJob] = OrderedDict()
        # llguidance: its tokenizer, the build thread and the builds it has not returned yet
        self._llg_tokens: LLTokenizer | None = None
        self._llg_thread: ThreadPoolExecutor | None = None
        self._llg_builds: list[tuple[CompileJob, Future[llg.LLGuidanceGrammar]]] = []
        self.fast = Lane("fast", 1, min(FAST_BUDGET_S, compile_timeout_s), 1)
        self.slow = Lane("slow", SLOW_WORKERS, compile_timeout_s, COMPILES_PER_TENANT)
        # The pickled vocabulary every worker reads first, in an unlinked file passed by fd:
        # no worker start blocks on a socket buffer, and nothing is left on disk.
        self._vocabulary_file = tempfile.TemporaryFile()
        self._vocabulary_file.write(pickle.dumps(self.vocabulary))
        self._vocabulary_file.flush()
        self._started = self._finished = self._killed = self._refused = 0
        self._longest_s = 0.0

    # ---- submitting and waiting ----------------------------------------------------------------
    def compile_async(
        self,
        regex: str | None = None,
        json_schema: str | dict[str, Any] | None = None,
        choices: list[str] | None = None,
        dtype: str | None = None,
        ebnf: str | None = None,
        lark: str | None = None,
        tenant: str = "",
    ) -> CompileJob:
        """Exactly one of: a regex; a JSON schema (str or dict); a list of literal choices; a
        dtype: "int" (JSON integer), "float" (JSON number), "bool" (true|false), "str" (a
        double-quoted JSON string); a GBNF grammar (`ebnf`); or a Lark grammar. Never raises:
        the job fails at once for a bad constraint, and otherwise finishes as `poll()` drives it."""
        values = (regex, json_schema, choices, dtype, ebnf, lark)
        given = {k: v for k, v in zip(CONSTRAINT_KINDS, values) if v is not None}
        if len(given) != 1:
            return self._failed(
                f"give exactly one of {', '.join(CONSTRAINT_KINDS)} (got {sorted(given)})"
            )
        kind, value = given.popitem()
        try:
            key = (tenant, kind, _key_text(kind, value))
        except ValueError as e:
            return self._failed(str(e))
        job = self._cache.get(key)
        if job is not None:
            self._cache.move_to_end(key)
            return job
        try:  # a failed check is cached too: `n` samples of a bad constraint check it once
            job = self._job(kind, value, tenant)
        except CompilerBusy as e:
            self._refused += 1
            return self._failed(str(e), busy=True)
        except (ValueError, RecursionError) as e:
            job = self._failed(str(e) or type(e).__name__)
        self._cache[key] = job
        self._trim_cache()
        self.poll()
        return job

    def _job(self, kind: str, value: Any, tenant: str) -> CompileJob:
        """A checked constraint's job, queued on the lane or thread that builds it; ValueError
        for a malformed constraint or one past the expansion budget, CompilerBusy for one its
        tenant may not queue now (`_take`)."""
        backend = self._backend(kind, value)
        if backend == "llguidance":
            if kind in ("choices", "dtype"):  # as their regexes
                kind, value = "regex", self._to_regex(kind, value)
            self._take(tenant)
            job = self._new_job(
                kind, value if isinstance(value, str) else json.dumps(value), tenant
            )
            self._build_llguidance(job, value)
            return job
        if kind == "json_schema":
            schema = load_schema(value)
            check_schema(schema)
            expanded = check_expansion(schema)
            job = self._new_job(kind, json.dumps(schema), tenant)
            cheap = expanded <= FAST_MAX_CHARS and _schema_looks_cheap(schema, job.pattern)
        else:
            job = self._new_job(kind, self._to_regex(kind, value), tenant)
            cheap = _looks_cheap(job.pattern)
        if not cheap:
            self._take(tenant)
        (self.fast if cheap else self.slow).push(job)
        return job

    def _take(self, tenant: str) -> None:
        """CompilerBusy unless the tenant has fewer than `compiles_per_tenant` expensive compiles
        (slow lane, llguidance thread) queued or running: past its cap a tenant is refused at
        once rather than queued. Cheap ones (the fast lane) are bounded by its budget instead."""
        if self._in_flight(tenant) >= self.compiles_per_tenant:
            raise CompilerBusy(
                f"too many constraints compiling for this tenant (at most "
                f"{self.compiles_per_tenant} at once); retry when one has finished"
            )

    def _new_job(self, kind: str, pattern: str, tenant: str) -> CompileJob:
        return CompileJob(
            kind, pattern, tenant, self.compile_timeout_s, time.monotonic() + self.wait_s
        )

    def compile(self, **constraint: Any) -> Grammar:
        """`compile_async`, waited for: the Grammar, or a ConstraintError."""
        job = self.compile_async(**constraint)
        while not job.done:
            conns = [w.conn for w in self._workers()]
            wait(conns, timeout=0.05) if conns else time.sleep(0.01)
            self.poll()
        return job.result()

    def ready(self, job: CompileJob) -> bool:
        """Whether `job` has finished (with a Grammar or an error), driving the lanes first."""
        if not job.done:
            self.poll()
        return job.done

    # ---- driving the lanes ---------------------------------------------------------------------
    def poll(self) -> None:
        """Read what the workers answered, kill overruns, fail jobs that waited too long, start
        queued jobs, stop idle workers. Never blocks on a worker for longer than reading a reply
        it has begun to send."""
        self._collect_llguidance()
        workers = self._workers()
        if workers:
            for conn in wait([w.conn for w in workers], timeout=0):
                self._receive(next(w for w in workers if w.conn is conn))
        now = time.monotonic()
        for lane in (self.fast, self.slow):
            for worker in list(lane.workers):
                if worker.job is not None and now > worker.deadline:
                    self._overran(lane, worker)
                elif worker.job is None and worker.ready and now - worker.started > IDLE_EXIT_S:
                    self._retire(lane, worker)
            for job in lane.expired(now):
                self._busy(job, f"the constraint compiler is busy: it waited {self.wait_s:g} s")
            self._dispatch(lane)

    def stats(self) -> CompileStats:
        return CompileStats(
            self._started,
            self._finished,
            self._killed,
            self._refused,
            self._longest_s,
            len(self._workers()),
        )

    def close(self) -> None:
        """Kill every worker and fail what was queued or running (the scheduler is going)."""
        for lane in (self.fast, self.slow):
            for worker in list(lane.workers):
                if worker.job is not None:
                    worker.job.fail("the runtime stopped before the constraint compiled")
                self._retire(lane, worker)
            self._fail_queued(lane, "the runtime stopped before the constraint compiled")
        for job, future in self._llg_builds:
            future.cancel()
            job.fail("the runtime stopped before the constraint compiled")
        self._llg_builds.clear()
        if self._llg_thread is not None:
            self._llg_thread.shutdown(wait=False, cancel_futures=True)
        self._vocabulary_file.close()

    # ---- internals -----------------------------------------------------------------------------
    def _workers(self) -> list[Worker]:
        return self.fast.workers + self.slow.workers

    def _in_flight(self, tenant: str) -> int:
        """The tenant's expensive jobs queued or building: the slow lane's, the llguidance
        thread's."""
        building = sum(1 for job, _ in self._llg_builds if job.tenant == tenant)
        return self.slow.in_flight(tenant) + building

    def _busy(self, job: CompileJob, why: str) -> None:
        """Fail `job` with CompilerBusy and forget it, so a retry compiles afresh."""
        self._refused += 1
        job.fail_busy(f"{job.kind} constraint not compiled: {why}; retry later")
        for key in [k for k, j in self._cache.items() if j is job]:
            del self._cache[key]

    def _lane_of(self, worker: Worker) -> Lane:
        return self.fast if worker in self.fast.workers else self.slow

    def _receive(self, worker: Worker) -> None:
        lane = self._lane_of(worker)
        try:
            reply = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._died(lane, worker)
            return
        if reply == wire.READY:
            worker.ready, worker.started = True, time.monotonic()
            return
        job, ran = worker.finish()
        self._finished += 1
        self._longest_s = max(self._longest_s, ran)
        status, body = reply[:1], reply[1:]
        try:
            if status == wire.INDEX:
                index = Index.from_binary(body)
                job.grammar = OutlinesGrammar(index, self.tokens, self.eos_token_id)
                job.grammar_bytes = len(body)
            elif status == wire.TOO_LARGE:
                job.fail(
                    f"{job.kind} constraint is too complex: its automaton takes {body.decode()}"
                )
            else:
                job.fail(
                    f"cannot compile {job.kind} constraint {job.pattern[:200]!r}: {body.decode()}"
                )
        except Exception as e:  # noqa: BLE001 (a reply that does not decode fails its job only)
            job.fail(f"cannot compile {job.kind} constraint: {type(e).__name__}: {e}")
        self._trim_cache()

    def _overran(self, lane: Lane, worker: Worker) -> None:
        """Kill a worker past its job's deadline; the job moves on to the slow lane while it has
        budget left, else it is too complex."""
        job, ran = worker.finish()
        self._killed += 1
        self._longest_s = max(self._longest_s, ran)
        self._retire(lane, worker)
        if lane is self.fast and job.budget_s > 0:
            self.slow.push(job)  # its wait keeps its first deadline
        else:
            logger.warning(
                "killed a %s constraint compile after %.1f s (%s lane)", job.kind, ran, lane.name
            )
            job.fail(
                f"{job.kind} constraint is too complex: compiling took over "
                f"{self.compile_timeout_s:g} s"
            )

    def _died(self, lane: Lane, worker: Worker) -> None:
        """A worker that exited on its own: out of memory (its RLIMIT_AS) or crashed in the build
        of its job, or failed to start, which fails what its lane had queued (no retry loop)."""
        self._killed += 1
        self._retire(lane, worker)
        code = worker.process.returncode
        if worker.job is not None:
            job, _ = worker.finish()
            job.fail(
                f"{job.kind} constraint is too complex: its compile ran out of memory "
                f"({WORKER_MEMORY_BYTES >> 20} MiB) or crashed (exit code {code})"
            )
        elif not worker.ready:
            logger.error("a constraint compile worker failed to start (exit code %s)", code)
            self._fail_queued(lane, "the constraint compiler is unavailable: its worker failed")

    def _retire(self, lane: Lane, worker: Worker) -> None:
        worker.stop()
        lane.workers.remove(worker)

    def _dispatch(self, lane: Lane) -> None:
        """Start queued jobs that their tenants' caps allow on idle ready workers, starting one
        more worker (up to the lane's size) when none is idle."""
        while (tenant := lane.next_tenant()) is not None:
            idle = next((w for w in lane.workers if w.ready and w.job is None), None)
            if idle is None:
                starting = any(not w.ready for w in lane.workers)
                if len(lane.workers) < lane.size and not starting:
                    self._start_worker(lane)
                return
            job = lane.pop(tenant)
            self._started += 1
            try:
                idle.start(job, min(lane.budget_s, job.budget_s))
            except OSError:  # it died since it last answered
                self._died(lane, idle)

    def _start_worker(self, lane: Lane) -> None:
        """One more worker for `lane`; when none can start (out of processes or memory), what
        the lane has queued fails instead of waiting forever."""
        try:
            lane.workers.append(Worker(self._vocabulary_file.fileno(), self.whitespace_pattern))
        except OSError as e:
            logger.error("cannot start a constraint compile worker: %s", e)
            self._fail_queued(lane, f"the constraint compiler is unavailable: {e}")

    @staticmethod
    def _fail_queued(lane: Lane, message: str) -> None:
        for queue in lane.queues.values():
            for job in queue:
                job.fail(message)
        lane.queues.clear()

    @staticmethod
    def _failed(message: str, busy: bool = False) -> CompileJob:
        """A job failed before it was queued (not cached)."""
        job = CompileJob("constraint", "", "", 0.0)
        job.fail_busy(message) if busy else job.fail(message)
        return job

    def _trim_cache(self) -> None:
        """Drop entries past `cache_size` or MAX_CACHE_BYTES, each time the least recently used
        of the tenant holding the most, so a tenant filling the cache evicts its own entries
        before another's (whose repeats would otherwise slow down, a signal across tenants). A
        dropped job still running finishes for the requests that hold it."""
        while len(self._cache) > self.cache_size or (
            len(self._cache) > 1
            and sum(j.grammar_bytes for j in self._cache.values()) > MAX_CACHE_BYTES
        ):
            held = Counter(tenant for tenant, _, _ in self._cache)
            most = max(held.values())
            del self._cache[next(k for k in self._cache if held[k[0]] == most)]

    def _build_llguidance(self, job: CompileJob, value: Any) -> None:
        """Queue the translation and build of `job` (`value` as the request gave it) on the
        llguidance thread (started, with llguidance's tokenizer, on first use); its time counts
        from now, queueing included. llguidance (and transformers under its tokenizer) is
        imported here, at the first grammar that needs it, not at every runtime's start."""
        from radixrt.structured import llguidance_backend as llg

        if self._llg_thread is None or self._llg_tokens is None:
            try:
                self._llg_tokens = llg.tokenizer(self.hf_tokenizer, self.vocab_size)
            except ValueError as e:
                job.fail(str(e))
                return
            self._llg_thread = ThreadPoolExecutor(1, thread_name_prefix="llguidance-compile")
        future = self._llg_thread.submit(
            llg.translate_and_build, self._llg_tokens, job.kind, value, self.eos_token_id
        )
        self._started += 1
        self._llg_builds.append((job, future))

    def _collect_llguidance(self) -> None:
        """Finish the llguidance jobs whose builds returned; fail those unfinished at their
        deadline: busy if the build has not begun within its wait, too complex if it has not ended
        within the compile timeout after that (llguidance's limits end it soon after)."""
        now = time.monotonic()
        for build in list(self._llg_builds):
            job, future = build
            if future.done():
                self._llg_builds.remove(build)
                self._finished += 1
                try:
                    job.grammar, job.grammar_bytes = future.result(), len(job.pattern)
                except ConstraintError as e:
                    job.error = e
                except Exception as e:  # noqa: BLE001 (a build's failure is its job's only)
                    job.fail(f"cannot compile {job.kind} constraint: {type(e).__name__}: {e}")
            elif not future.running() and now > job.wait_until:
                self._llg_builds.remove(build)
                future.cancel()
                self._busy(job, f"the constraint compiler is busy: it waited {self.wait_s:g} s")
            elif now > job.wait_until + self.compile_timeout_s:
                self._llg_builds.remove(build)
                self._killed += 1
                job.fail(
                    f"{job.kind} constraint is too complex: compiling took over "
                    f"{self.compile_timeout_s:g} s"
                )

    def _backend(self, kind: str, value: Any) -> str:
        """Who compiles a constraint: llguidance for CFGs and for JSON schemas with keywords only
        it enforces (GRAMMAR_KEYWORDS), else `--grammar-backend`. ValueError for a malformed
        schema."""
        backend = backend_for(kind, self.backend)
        if backend == "outlines" and kind == "json_schema" and needs_grammar(load_schema(value)):
            return "llguidance"
        return backend

    @staticmethod
    def _to_regex(kind: str, value: Any) -> str:
        """The regex of a regex, choices or dtype constraint, checked for type and size;
        ValueError says what is wrong."""
        if kind == "regex":
            check_regex(value)
            return cast(str, value)  # check_regex raised unless it is a string
        if kind == "choices":
            if (
                not isinstance(value, list)
                or not value
                or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) for c in value)
            ):
                raise ConstraintError(
                    f"choices must be a non-empty list of at most {MAX_CHOICES} strings"
                )
            pattern = "(" + "|".join(re.escape(c) for c in value) + ")"
            check_regex(pattern, "choices' regex")
            return pattern
        if not isinstance(value, str) or value not in DTYPE_REGEXES:
            raise ConstraintError(
                f"unknown dtype {value!r}; expected one of {sorted(DTYPE_REGEXES)}"
            )
        return DTYPE_REGEXES[value]


def _looks_cheap(pattern: str) -> bool:
    """Whether a regex goes to the fast lane: short, and no counted repetition past
    FAST_MAX_REPEAT (the DFA grows with those counts). A guess: the fast lane's budget bounds
    the cost of a wrong one."""
    return len(pattern) <= min(FAST_MAX_CHARS, MAX_REGEX_CHARS) and _small_repeats(pattern)


def _small_repeats(text: str) -> bool:
    """No counted repetition `{m,n}` in `text` past FAST_MAX_REPEAT."""
    return all(int(high or low) <= FAST_MAX_REPEAT for low, high in _REPEAT.findall(text))


def _schema_looks_cheap(schema: dict[str, Any], text: str) -> bool:
    """Whether a JSON schema's compile goes to the fast lane (its expansion is already known to
    be short): no length or item count past FAST_MAX_REPEAT, nor a counted repetition past it in
    a `pattern` (its text, `text`, holds them as given)."""
    counts = ("minLength", "maxLength", "minItems", "maxItems")
    return _small_repeats(text) and all(
        node.get(k, 0) <= FAST_MAX_REPEAT for _, node in schema_nodes(schema) for k in counts
    )


def _key_text(kind: str, value: Any) -> str:
    """A constraint as the cache keys it, before any translation: a string as given, anything
    else as its JSON (in the order given: a schema's property order is its output's), checked for
    nesting first; ValueError for a value that is not JSON or longer than MAX_KEY_CHARS (no
    check would accept it, and the cache holds its key)."""
    if isinstance(value, str):
        text = value
    elif nesting_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{kind} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:  # a map with non-string keys or non-JSON values
            raise ValueError(f"{kind} is not JSON: {e}") from None
    if len(text) > MAX_KEY_CHARS:
        raise ValueError(f"{kind} has {len(text)} chars; at most {MAX_KEY_CHARS}")
    return text
