"""The Triton attention kernels and the packed-weight GEMM compiled ahead of time for a CUDA
architecture, with no GPU: Triton's own compiler down to PTX and its bundled ptxas. Run as a script (the tests run it in a
child process: theirs interprets the kernels, and an interpreted kernel compiles nothing), it
prints one JSON object: for each case, the PTX's global loads by width.

    PYTHONPATH=. python tests/kernels/gpu_compile.py
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radixrt.kernels import decode_attention, extend_attention, packed_gemm

HQ, HKV, D = 32, 8, 128  # llama3-8b's heads
POINTERS = {
    "Q": "*bf16",
    "K_ext": "*bf16",
    "V_ext": "*bf16",
    "O": "*bf16",
    "Mid_O": "*fp32",
    "Mid_LSE": "*fp32",
    "qo_indptr": "*i32",
    "kv_indptr": "*i32",
    "kv_indices": "*i32",
}
COMMON = dict(GROUP=HQ // HKV, HEAD_DIM=D, BLOCK_D=D, LOGIT_CAP=0.0, WINDOW=0, DOT_PRECISION="tf32")
KERNELS = {
    "decode": (decode_attention._decode_split_kernel, dict(BLOCK_H=16, BLOCK_N=64)),
    "extend": (extend_attention._extend_kernel, dict(BLOCK_M=128, BLOCK_N=64)),
}
# (kernel, KV_KIND, compute capability): each quantized kind on sm_90, and E4M3 on sm_80 (no
# FP8 instructions there: the codes decode through half-precision bits)
CASES = [
    ("decode", 0, 90),
    ("decode", 1, 90),
    ("decode", 2, 90),
    ("extend", 1, 90),
    ("decode", 1, 80),
]
# (packed weight format, compute capability): the GEMM of bf16 activations, a decode tile
GEMM_CASES = [(fmt, arch) for fmt in packed_gemm.Format for arch in (90, 80)]
GEMM_POINTERS = {"X": "*bf16", "W": "*i32", "B": "*fp32", "Y": "*bf16"}


def global_loads(kernel: str, kind: int, arch: int) -> dict[str, int]:
    """`kernel` ("decode" or "extend") over a pool of KV_KIND `kind`, compiled for sm_`arch`:
    its PTX's global loads by instruction (e.g. `ld.global.b32`). The pointers are given
    16-byte aligned, as torch allocates; the pool's strides are runtime values."""
    fn, blocks = KERNELS[kernel]
    names = list(inspect.signature(fn.fn).parameters)
    constants = {**COMMON, **blocks, "KV_KIND": kind}
    pool = "*i8" if kind >= 0 else "*bf16"

    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in ("K_buf", "V_buf"):
            return pool
        return POINTERS.get(name, "fp32" if name == "sm_scale" else "i32")

    return _loads(fn, {n: arg_type(n) for n in names}, constants, arch)


def gemm_loads(fmt: packed_gemm.Format, arch: int) -> dict[str, int]:
    """`packed_gemm`'s kernel over weights of format `fmt`, bf16 activations, a bias and a
    decode tile, compiled for sm_`arch`: its PTX's global loads by instruction."""
    fn = packed_gemm._packed_linear_kernel
    names = list(inspect.signature(fn.fn).parameters)
    launch = packed_gemm.launch_config(1, 128)
    constants = {
        "BLOCK_M": launch.block_m,
        "BLOCK_N": launch.block_n,
        "FORMAT": fmt.value,
        "OFFSETS": fmt is packed_gemm.Format.GROUPS4,  # asymmetric 4-bit; 8-bit's implied
        "HAS_BIAS": True,
        "DOT_PRECISION": "tf32",
    }
    scales = "*fp32" if fmt is packed_gemm.Format.CHANNEL8 else "*fp16"

    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        return scales if name == "S" else GEMM_POINTERS.get(name, "i32")

    return _loads(fn, {n: arg_type(n) for n in names}, constants, arch)


def _loads(fn, signature: dict[str, str], constants: dict, arch: int) -> dict[str, int]:
    """`fn` compiled for sm_`arch` with `signature` and `constants`, its pointers 16-byte
    aligned as torch allocates them: its PTX's global loads by instruction."""
    names = list(signature)
    aligned = [n for n, t in signature.items() if t.startswith("*")]
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2}
    )
    return dict(Counter(re.findall(r"ld\.global(?:\.\w+)+", compiled.asm["ptx"])))


def slot_kernel_ptx(fn, constants: dict, pointers: dict[str, str], arch: int) -> str:
    """The PTX of a kernel over per-request state slots (`gated_delta`, `ssd`, `causal_conv`)
    compiled for sm_`arch` with `constants`, `pointers` the types of its pointer arguments
    (every other one i32): pointers 16-byte aligned and strides multiples of 16, as torch
    allocates them at the tests' shapes and as Triton specializes such arguments on launch."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    aligned = [n for n in names if n in pointers or n.startswith("stride")]
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    ptx: str = compiled.asm["ptx"]
    return ptx


def global_accesses(ptx: str) -> dict[str, int]:
    """A PTX's global loads and stores by instruction (e.g. `st.global.v4.b32`)."""
    return dict(Counter(re.findall(r"(?:ld|st)\.global(?:\.\w+)+", ptx)))


def compiled_in_child(script: str) -> dict:
    """What `script` prints (its last line, JSON) run as a program with Triton compiling rather
    than interpreting (a test's process interprets the kernels, and an interpreted kernel
    compiles nothing), this folder importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    child = subprocess.run(
        [sys.executable, "-P", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-2000:]
    result: dict = json.loads(child.stdout.splitlines()[-1])
    return result


if __name__ == "__main__":
    loads = {f"{k} {kind} sm_{arch}": global_loads(k, kind, arch) for k, kind, arch in CASES}
    loads.update({f"gemm {fmt.name} sm_{arch}": gemm_loads(fmt, arch) for fmt, arch in GEMM_CASES})
    print(json.dumps(loads))
