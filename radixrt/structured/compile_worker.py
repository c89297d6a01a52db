"""The child process that builds outlines-core Indexes for `radixrt.structured.compiler`.

Run as a script (`python -I compile_worker.py SOCKET_FD VOCABULARY_FD MEMORY_BYTES INDEX_BYTES
REGEX_CHARS WHITESPACE`),
never imported by the runtime for its work: it imports only the standard library and
outlines-core, so it starts in a fraction of a second. It talks to its parent over the socket
SOCKET_FD with `multiprocessing.connection` framing:

- first it reads the pickled `Vocabulary` from the file VOCABULARY_FD (which its parent wrote;
  the child unpickles only that, never anything from a network socket) and answers `READY`;
- then, per job, the parent sends `CHECK_SYNTAX|BUILD` + a regex as UTF-8, or `BUILD_SCHEMA` +
  a JSON schema's text (translated here to its regex, compact JSON apart from WHITESPACE, a
  regex of at most REGEX_CHARS chars: the translation is as unbounded in time as the build, so
  it runs where it can be killed), and the child answers `INDEX` + the Index's own binary form
  (`Index.from_binary` reads it, no pickle), or `ERROR` + a message as UTF-8, or `TOO_LARGE` +
  the size of an Index whose binary form is over INDEX_BYTES.

Limits: the address space is capped at MEMORY_BYTES (an allocation past it aborts the child,
which the parent reports as too complex), and the child dies with its parent (PR_SET_PDEATHSIG).
The parent kills it when a job overruns its time budget.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import resource
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

READY, INDEX, ERROR, TOO_LARGE = b"R", b"I", b"E", b"L"
CHECK_SYNTAX, BUILD, BUILD_SCHEMA = b"S", b"B", b"J"
PR_SET_PDEATHSIG = 1

_PROBE_VOCABULARY = Vocabulary(1, {b"\x00": [0]})


def _die_with_parent() -> None:
    """SIGKILL this process when the parent goes (Linux; elsewhere the closed socket ends it
    once the current build returns)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def check_syntax(regex: str) -> str | None:
    """The syntax error of `regex` alone (an unbalanced one could turn valid once wrapped),
    parsed against a one-token vocabulary: a syntax error fails to build the DFA, anything
    else only mismatches the vocabulary. None when it parses."""
    try:
        Index(regex, _PROBE_VOCABULARY)
    except ValueError as e:
        if "DFA" in str(e):
            return (
                f"invalid regex (Rust regex-automata syntax: no lookaround or backreferences): {e}"
            )
    return None


def build(regex: str, vocabulary: Vocabulary) -> bytes:
    """The Index of the whole-output match of `regex`, in its binary form.

    outlines-core 0.2.x drops every token edge from an accepting state into a non-accepting one
    (regex-automata reports matches one byte late), so `1(\\.5)?` could never reach "1.5".
    Anchoring at end of input makes no state before the end a match state."""
    data: bytes = Index(f"(?:{regex})\\z", vocabulary).__reduce__()[1][0]
    return data


@dataclass(frozen=True)
class Limits:
    """What a worker builds at most: an Index's binary form, a schema's regex; and the
    whitespace a schema's regex allows between tokens."""

    index_bytes: int
    regex_chars: int
    whitespace: str


def schema_regex(schema: str, whitespace: str, max_chars: int) -> str:
    """The regex of a JSON schema's text (checked by the caller: `regexes.schema_regex`, or the
    parent); ValueError when outlines-core cannot translate it or its regex is over `max_chars`."""
    try:
        regex: str = build_regex_from_schema(schema, whitespace)
    except Exception as e:  # noqa: BLE001 (outlines-core raises several types for bad schemas)
        raise ValueError(f"unsupported JSON schema: {e}") from None
    if len(regex) > max_chars:
        raise ValueError(f"json_schema's regex has {len(regex)} chars; at most {max_chars}")
    return regex


def answer(job: bytes, vocabulary: Vocabulary, limits: Limits) -> bytes:
    """The reply to one job: an Index, or the reason there is none."""
    flag, text = job[:1], job[1:].decode()
    try:
        if flag == BUILD_SCHEMA:
            text = schema_regex(text, limits.whitespace, limits.regex_chars)
    except ValueError as e:
        return ERROR + str(e).encode()
    try:
        error = check_syntax(text) if flag == CHECK_SYNTAX else None
        if error:
            return ERROR + error.encode()
        index = build(text, vocabulary)
    except Exception as e:  # noqa: BLE001 (any failure is this job's verdict, not the worker's end)
        return ERROR + f"{type(e).__name__}: {e}".encode()
    max_bytes = limits.index_bytes
    if len(index) > max_bytes:
        return (
            ERROR
            + (
                f"too complex: its automaton takes {len(index) >> 20} MiB (at most {max_bytes >> 20})"
            ).encode()
        )
    return INDEX + index


def main(socket_fd: int, vocabulary_fd: int, memory_bytes: int, limits: Limits) -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn = Connection(socket_fd)
    # pread: the parent and its other workers share this descriptor's file offset
    blob = os.pread(vocabulary_fd, os.fstat(vocabulary_fd).st_size, 0)
    os.close(vocabulary_fd)
    vocabulary = pickle.loads(blob)
    conn.send_bytes(READY)
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:  # the parent closed the socket: this worker is done
            return
        conn.send_bytes(answer(job, vocabulary, limits))


if __name__ == "__main__":
    socket_fd, vocabulary_fd, memory_bytes, index_bytes, regex_chars = map(int, sys.argv[1:6])
    main(socket_fd, vocabulary_fd, memory_bytes, Limits(index_bytes, regex_chars, sys.argv[6]))
