"""Which instruction-set path the CPU's weight kernels take (`--cpu-isa`), chosen once at start.

Paths, best first: `amx` (on CPUs with AMX-INT8 tiles whose OS grants them, Sapphire Rapids
and later: `int4_gemm`'s many-row multiplies on the tile unit, 16 weight rows by 16 activation
rows a tile, and everything else avx512-vnni's code; the same bits out), `avx512-vnni` (the same C kernels of `int4_gemm` and `int8_gemm` with their
integer dot products in `vpdpbusd`/`vpdpwssd`, 256 bits wide on the same 8-row panels: one
weight layout for every path, and the same bits out as avx2's, since both sums are exact; the
16-bit widths' float multiply-adds 512 bits wide, a panel's pair of inputs a vector, the same
bits too),
`avx-vnni` (the same source and instructions in their VEX form, for CPUs with AVX-VNNI and no
AVX-512: Alder Lake and later client cores; it builds on any host with GCC 11+, and runs only
where the CPU has it), `avx2` (`vpmaddubsw`/`vpmaddwd`; needs AVX2, FMA and F16C, and a C
compiler) and `torch` (the packed weights dequantized on each call and multiplied by torch:
slow, but any CPU runs it).
`auto` takes the best this host runs; a CPU without AVX2 falls back to torch with one warning.
Naming a path this host cannot run is refused in one line.
"""

from __future__ import annotations

import ctypes
import enum
import logging
from functools import cache

from . import native

logger = logging.getLogger(__name__)


class Isa(str, enum.Enum):
    """A path, by its `--cpu-isa` name."""

    AMX = "amx"
    AVX512_VNNI = "avx512-vnni"
    AVX_VNNI = "avx-vnni"
    AVX2 = "avx2"
    TORCH = "torch"

    @property
    def cflags(self) -> tuple[str, ...]:
        """The compiler flags a native path's kernels are built with, beyond `native.FLAGS`
        (`-march=native` already names the host's; these say what the source relies on):
        `VNNI` for the integer dot products, `AVX512` for 512-bit vectors (`int4_gemm`'s 16-bit
        widths), which the source cannot read off `-march=native` (an avx2 build on an AVX-512
        host has it)."""
        avx512 = ("-DVNNI", "-DAVX512", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni")
        if self is Isa.AMX:
            return (*avx512, "-DAMX", "-mamx-tile", "-mamx-int8")
        if self is Isa.AVX512_VNNI:
            return avx512
        if self is Isa.AVX_VNNI:  # GCC maps the same intrinsics to the VEX encodings
            return ("-DVNNI", "-mavxvnni")
        return ()


CHOICES = ("auto", *(isa.value for isa in Isa))
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512_VNNI = _AVX2 | {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"}
NEEDS = {  # /proc/cpuinfo flags a native path needs, best path first
    Isa.AMX: _AVX512_VNNI | {"amx_tile", "amx_int8"},
    Isa.AVX512_VNNI: _AVX512_VNNI,
    Isa.AVX_VNNI: _AVX2 | {"avx_vnni"},
    Isa.AVX2: _AVX2,
}


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def host_paths() -> list[Isa]:
    """The paths this host runs, best first: its CPU has the instructions, for a native path
    there is a C compiler to build the kernels, and for AMX the OS grants the tile state."""
    native_ok = native.find_compiler() is not None
    flags = cpu_flags()
    runs = [isa for isa, needs in NEEDS.items() if native_ok and needs <= flags]
    if Isa.AMX in runs and not amx_granted():
        runs.remove(Isa.AMX)
    return runs + [Isa.TORCH]


@cache
def amx_granted() -> bool:
    """Ask Linux for AMX's tile data state for this process (arch_prctl ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA): a tile instruction without it faults. False where it is refused or
    the call does not exist (not Linux, or a kernel before 5.16)."""
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 Linux's numbers
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status: int = libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata)
        return status == 0
    except (OSError, AttributeError):
        return False


def resolve(name: str, paths: list[Isa]) -> Isa:
    """The path `--cpu-isa name` takes on a host that runs `paths` (`host_paths()`, best
    first). ValueError, one line, for a path the host cannot run or a name that is no path."""
    if name == "auto":
        if paths[0] is Isa.TORCH:
            logger.warning(
                "this CPU lacks AVX2 (or there is no C compiler): quantized linears run in "
                "torch (--cpu-isa torch), dequantizing their weights on every call, much slower"
            )
        return paths[0]
    if name not in CHOICES:
        raise ValueError(f"--cpu-isa {name!r} is no path; choose one of {list(CHOICES)}")
    isa = Isa(name)
    if isa not in paths:
        needs = " ".join(sorted(NEEDS[isa]))
        granted = ", the OS's grant of the tile state," if isa is Isa.AMX else ""
        runs = ", ".join(p.value for p in paths)
        raise ValueError(
            f"--cpu-isa {name}: this host cannot run it (it needs the CPU flags {needs}{granted}"
            f" and a C compiler; this host runs: {runs})"
        )
    return isa
