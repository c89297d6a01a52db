"""`triton.jit` as the type checker sees it.

Triton ships no type information, so to mypy `triton.jit` is untyped and every kernel it
decorates is `Any`. `jit` is the same decorator, returning what the host code does with a
kernel: launch it on a grid (`kernel[grid](*args, **constexprs)`) or, from another kernel, call
it. The kernels' parameters are annotated `tl.constexpr` or `tl.tensor` (what a non-constexpr
argument is inside a kernel: a pointer or a scalar); never `int` or `float`, which Triton would
read as the argument's type and compile as i32 or fp32 instead of specializing it by its value
(tests/kernels/test_jit_signatures.py holds every kernel to that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import triton

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


class Kernel(Protocol):
    """A `triton.jit` function."""

    def __getitem__(self, grid: Grid) -> Callable[..., object]:
        """The kernel launched on `grid` (its arguments are the kernel's, untyped here)."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Called from another kernel's body (traced by Triton, not run as Python)."""
        ...


def jit(fn: Callable[..., object]) -> Kernel:
    """`triton.jit(fn)`, typed as a `Kernel`."""
    kernel: Kernel = triton.jit(fn)
    return kernel
