"""C kernels for the CPU, compiled once with the system's C compiler and called through ctypes.

The sources are C files in `csrc/` beside this module (`CSRC`): a kernel's `.c` file, the headers
it shares with the others (`avx2.h`) and, for `cpu_layer`, the other kernels' `.c` files, joined
by `#include`. No torch headers and no build step at install: a kernel is compiled on first use
(about a second), in place (`-I csrc`, so a compiler error names the real file and line), into
`$RADIXRT_CACHE_DIR/kernels` (default `~/.cache/radixrt/kernels`), keyed by the content of every
file it includes, the flags and the CPU model, since `-march=native` code is only valid where it
was built: an edit to any of its files rebuilds it. Without a compiler, or when the build fails
(the compiler's whole message is logged), `load` returns None and callers keep their torch path.
The libraries use OpenMP; torch's own libgomp is already loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import TypeAlias

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Helpers every AVX2 kernel starts with (`csrc/avx2.h`), for C given as a string (`load`'s
# `source`): radixrt.bench's probes prepend it to theirs.
AVX2_PRELUDE = (CSRC / "avx2.h").read_text()
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
POINTER, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# a C function's name and its arguments' types (it returns void)
Signature: TypeAlias = tuple[
    str, tuple[type[ctypes.c_void_p] | type[ctypes.c_int64] | type[ctypes.c_float], ...]
]
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class CompileError(RuntimeError):
    """The compiler refused a source; the message is its whole output (file:line: error ...)."""


def cache_dir() -> Path:
    root = os.environ.get("RADIXRT_CACHE_DIR") or Path.home() / ".cache" / "radixrt"
    return Path(root) / "kernels"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


@cache
def find_compiler() -> str | None:
    """The C compiler (`$CC`, else `cc`), or None. Without one, it warns once: every C kernel
    falls back to its torch path, so a CPU decode step is slower. The torch attention backend
    calls it when built on the CPU, so the warning comes at start, not at the first request."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning(
            "no C compiler (cc, or $CC): the CPU kernels fall back to torch, which is slower "
            "(int8 and the fused float32 paths need them); install one, e.g. apt-get install gcc"
        )
    return compiler


def included(source: Path | str) -> list[Path]:
    """The files a source is built from: the file itself (for a path) and every file it
    `#include "..."`s, transitively, each once, in the order first met. A quoted name is looked
    up beside the file that names it, then in `CSRC` (the compiler's order with `-I csrc`);
    system headers (`<...>`) are the compiler's and not listed."""
    found: list[Path] = []

    def visit(text: str, here: Path) -> None:
        for name in _INCLUDE.findall(text):
            path = next((d / name for d in (here, CSRC) if (d / name).is_file()), None)
            if path is not None and path.resolve() not in found:
                found.append(path.resolve())
                visit(path.read_text(), path.parent)

    if isinstance(source, Path):
        found.append(source.resolve())
        visit(source.read_text(), source.parent)
    else:
        visit(source, CSRC)
    return found


def source_key(source: Path | str, flags: tuple[str, ...]) -> str:
    """The cache key of a build: every included file's name and content, the source string's
    own (for a string), the flags and the CPU model."""
    digest = hashlib.sha256()
    if isinstance(source, str):
        digest.update(source.encode() + b"\0")
    for path in included(source):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\n".join([*flags, _cpu_model()]).encode())
    return digest.hexdigest()[:16]


@cache
def load(
    name: str,
    source: Path | str,
    signatures: tuple[Signature, ...],
    flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """The library built from `source` (a C file, usually under `CSRC`, or C text) with
    `flags` after the common ones, each `(function, argtypes)` of `signatures` declared (all
    return void), or None where it cannot be built."""
    flags = FLAGS + flags
    compiler = find_compiler()
    if compiler is None:
        return None
    path = cache_dir() / f"{name}-{source_key(source, flags)}.so"
    if not path.exists():
        try:
            _build(compiler, name, source, flags, path)
        except CompileError as error:
            logger.warning("the %s kernel did not compile:\n%s", name, error)
            return None
    lib = ctypes.CDLL(str(path))
    for function, argtypes in signatures:
        getattr(lib, function).restype = None
        getattr(lib, function).argtypes = list(argtypes)
    return lib


def built(library: ctypes.CDLL | None) -> ctypes.CDLL:
    """`library` as `load` gave it, to a caller whose availability check already found it built."""
    assert library is not None, "a kernel ran where its library did not build"
    return library


def compile_library(compiler: str, source: Path, flags: tuple[str, ...], output: Path) -> None:
    """Compile the C file `source` in place (`-I CSRC`) into the shared library `output`;
    CompileError with the compiler's whole output (which names the file and line) on failure."""
    command = [compiler, *flags, "-I", str(CSRC), str(source), "-o", str(output), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(result.stderr.strip() or f"{compiler} exited {result.returncode}")


def _build(
    compiler: str, name: str, source: Path | str, flags: tuple[str, ...], path: Path
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / f"{name}.so"
        if isinstance(source, str):  # C text: written out, its errors name `name`.c
            text, source = source, Path(tmp) / f"{name}.c"
            source.write_text(text)
        compile_library(compiler, source, flags, built)
        os.replace(built, path)  # atomic: a concurrent build finds a whole file or none
