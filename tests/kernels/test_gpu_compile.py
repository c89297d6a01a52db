"""The Triton attention kernels over a quantized pool and the packed-weight GEMM compile for
real GPUs (sm_90, and sm_80 without FP8 instructions), ahead of time and with no GPU
(`gpu_compile`), and load a quantized row's codes, or a packed weight's integers, a word at a
time: no byte-wide global load is left in their PTX."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_compile

REPO = Path(__file__).resolve().parents[2]


def test_quantized_kernels_compile_for_the_gpu_and_load_codes_by_word():
    # a child process: this one runs the kernels interpreted, and those compile nothing
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, gpu_compile.__file__],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    loads = json.loads(child.stdout.splitlines()[-1])
    gemms = {f"gemm {fmt.name} sm_{arch}" for fmt, arch in gpu_compile.GEMM_CASES}
    assert set(loads) == {f"{k} {kind} sm_{arch}" for k, kind, arch in gpu_compile.CASES} | gemms
    for case, widths in loads.items():
        assert widths.get("ld.global.b32"), f"{case}: no word-wide loads"
        assert "ld.global.b8" not in widths, f"{case}: codes loaded byte by byte: {widths}"
