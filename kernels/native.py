"""C kernels for the CPU, compiled once with the system's C compiler and called through ctypes.

No torch headers and no build step at install: a kernel's source is compiled on first use (about
a second) into `$RADIXRT_CACHE_DIR/kernels` (default `~/.cache/radixrt/kernels`), keyed by the
source, the flags and the CPU model, since `-march=native` code is only valid where it was built.
Without a compiler, or when the build fails, `load` returns None and callers keep their torch path.
The libraries use OpenMP; torch's own libgomp is already loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

# Helpers every AVX2 kernel source starts with.
AVX2_PRELUDE = r"""
#include <immintrin.h>
#include <stdint.h>

/* The sum of a vector's eight lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
"""
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
POINTER, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


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


@cache
def load(
    name: str, source: str, signatures: tuple[tuple[str, tuple], ...], flags: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """The library built from `source` (with `flags` after the common ones) with each
    `(function, argtypes)` of `signatures` declared (all return void), or None where it cannot
    be built."""
    flags = FLAGS + flags
    compiler = find_compiler()
    if compiler is None:
        return None
    key = hashlib.sha256("\n".join([source, *flags, _cpu_model()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    if not path.exists() and not _build(compiler, name, source, flags, path):
        return None
    lib = ctypes.CDLL(str(path))
    for function, argtypes in signatures:
        getattr(lib, function).restype = None
        getattr(lib, function).argtypes = list(argtypes)
    return lib


def _build(compiler: str, name: str, source: str, flags: tuple[str, ...], path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        result = subprocess.run(
            [compiler, *flags, str(src), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            logger.warning("the %s kernel did not compile: %s", name, result.stderr[-500:])
            return False
        os.replace(built, path)  # atomic: a concurrent build finds a whole file or none
    return True
