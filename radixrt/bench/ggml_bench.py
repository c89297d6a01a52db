"""llama.cpp's own benchmarks beside `--workload kernels`, from the llama.cpp that `make
bench-peers` builds (the sources llama-cpp-python vendors): `test-backend-ops perf -o MUL_MAT`
(ggml's matrix multiply on its perf cases' shape, N 4096 x K 14336, an 8B model's FFN down) and
`llama-bench -p 32,128,512 -n 128` on the 1.1B shape's GGUF where `--model-shape` has made it.
Both are read through their machine-readable output (test-backend-ops' SQL, whose records carry
the figures its CSV leaves out, loaded into an in-memory SQLite; llama-bench's JSON); a binary
that is not built is skipped with one line saying so.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

from radixrt.bench.peers import llama_cpp_tool

PERF_SHAPE = (4096, 14336)  # N, K of test-backend-ops' MUL_MAT perf cases
PERF_ROWS = (1, 4, 8, 512)  # the rows (ggml's n) of those cases that this suite also runs
PERF_TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0"}  # ggml's type names -> GGUF's
PROMPTS = (32, 128, 512)
GENERATED = 128
TIMEOUT_S = 900


@dataclass(frozen=True)
class GgmlMulMat:
    """ggml's MUL_MAT at `rows` rows of float32 activations over `kind` weights, GOP/s."""

    kind: str
    rows: int
    gops: float


@dataclass(frozen=True)
class LlamaBenchRow:
    """llama-bench's figure for one test: pp<N> (a prompt of N tokens) or tg<N> (N generated),
    tokens a second (mean and standard deviation over its repetitions)."""

    test: str
    tokens_per_s: float
    stddev: float


def perf_threads(cpus: int) -> int:
    """The threads test-backend-ops gives the CPU backend: half the logical CPUs (it assumes
    two hardware threads a core), at least one."""
    return max(1, cpus // 2)


def mul_mat() -> list[GgmlMulMat]:
    """test-backend-ops' MUL_MAT perf cases of PERF_TYPES at PERF_ROWS on the CPU backend, at
    `perf_threads` threads ([] and a line printed without the binary)."""
    exe = llama_cpp_tool("test-backend-ops")
    if exe is None:
        print("test-backend-ops skipped: not built (make bench-peers)")
        return []
    n, k = PERF_SHAPE
    types = "|".join(PERF_TYPES)
    rows = "|".join(map(str, PERF_ROWS))
    pattern = f"type_a=({types}),type_b=f32,m={n},n=({rows}),k={k},"
    out = subprocess.run(
        [str(exe), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", pattern, "--output", "sql"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT_S,
    ).stdout
    return parse_mul_mat(out)


def parse_mul_mat(text: str) -> list[GgmlMulMat]:
    """The supported MUL_MAT records of test-backend-ops' SQL output (its table's statement
    and its INSERT lines; the progress lines between them ignored). `flops` is FLOP a second."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("CREATE TABLE"))
    script = lines[start : lines.index(");", start) + 1]
    script += [line for line in lines if line.startswith("INSERT INTO")]
    db = sqlite3.connect(":memory:")
    db.executescript("\n".join(script))
    found = []
    query = "SELECT op_params, flops FROM test_backend_ops WHERE op_name = 'MUL_MAT' AND supported"
    for op_params, flops in db.execute(query):
        params = dict(re.findall(r"(\w+)=([^,\)\]]+)", op_params))
        found.append(GgmlMulMat(PERF_TYPES[params["type_a"]], int(params["n"]), flops / 1e9))
    db.close()
    return found


def llama_bench(gguf: Path, threads: int) -> list[LlamaBenchRow]:
    """llama-bench on `gguf`: prompts of PROMPTS tokens and GENERATED tokens generated, with
    `threads` threads ([] and a line printed without the binary)."""
    exe = llama_cpp_tool("llama-bench")
    if exe is None:
        print("llama-bench skipped: not built (make bench-peers)")
        return []
    prompts = ",".join(map(str, PROMPTS))
    out = subprocess.run(
        [str(exe), "-m", str(gguf), "-t", str(threads), "-p", prompts, "-n", str(GENERATED)]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT_S,
    ).stdout
    return parse_llama_bench(out)


def parse_llama_bench(text: str) -> list[LlamaBenchRow]:
    """llama-bench's JSON records as pp<N>/tg<N> rows."""
    rows = []
    for rec in json.loads(text):
        prompt, gen = int(rec["n_prompt"]), int(rec["n_gen"])
        test = f"pp{prompt}" if prompt else f"tg{gen}"
        rows.append(LlamaBenchRow(test, float(rec["avg_ts"]), float(rec["stddev_ts"])))
    return rows
