"""`--workload kernels`: the CPU's quantized GEMM on the 1.1B shape (TinyLlama: hidden 2048,
intermediate 5632, 32 heads, 4 KV heads), no model loaded. GOP/s (2 M N K a second over one
layer's four linears: qkv, o, gate_up, down) at M = 1, 4, 32, 128, 512 rows, for each path this
host runs (`--cpu-isa`'s: avx512-vnni, avx-vnni, avx2; torch, the packed weights dequantized on
each call) and for the kernel before the lane-interleaved panels (`kernel_baseline`), alternated rep
by rep in one sitting, medians. At few rows four layers' weights are cycled (about 110 MB in int4, past any
L3), so that they are read from memory: the host's read bandwidth is measured too, and each
path's weight reads at M = 1 are reported as a fraction of it; from 32 rows one layer is
multiplied (the kernels are bound by arithmetic there), and the torch path always multiplies
one layer. Threads: torch's (`OMP_NUM_THREADS`).

Beside it, in the same sitting, llama.cpp's own figures where `make bench-peers` built them
(`ggml_bench`): ggml's MUL_MAT perf cases (Q4_0 and Q8_0 weights, N 4096 x K 14336) with
radixrt's GEMM on the same shape, formats and thread count (Q4_0's symmetric 4-bit groups, Q8_0's
8-bit ones), and llama-bench's prompt and generation speed on the 1.1B shape's Q4_0 GGUF (made by
`--model-shape tinyllama-1.1b`), its prompts' speed also as GOP/s of the model's linears, to set
beside the table's rows. Into `kernels.json`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from radixrt.bench.ggml_bench import (
    PERF_ROWS,
    PERF_SHAPE,
    PERF_TYPES,
    llama_bench,
    mul_mat,
    perf_threads,
)
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.shapes import SHAPES, gguf_path

ROWS = (1, 4, 32, 128, 512)
LAYERS = 4  # cycled at few rows, so that the weights are read from memory, not from cache
FEW_ROWS = 4
REPS = 3
BANDWIDTH_BYTES = 512 << 20
Runner = Callable[[list[Any], dict[int, torch.Tensor]], None]  # one layer's multiplies

READ_SOURCE = r"""
/* The sum of x [n] (n a multiple of 1024): every byte read once, by every thread in turn. */
float read_sum(const float *x, int64_t n) {
    float total = 0.0f;
    #pragma omp parallel for reduction(+ : total) schedule(static)
    for (int64_t c = 0; c < n / 1024; c++) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (const float *p = x + c * 1024; p < x + (c + 1) * 1024; p += 32) {
            s0 = _mm256_add_ps(s0, _mm256_load_ps(p));
            s1 = _mm256_add_ps(s1, _mm256_load_ps(p + 8));
            s2 = _mm256_add_ps(s2, _mm256_load_ps(p + 16));
            s3 = _mm256_add_ps(s3, _mm256_load_ps(p + 24));
        }
        total += hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    }
    return total;
}
"""


@dataclass(frozen=True)
class KernelRow:
    """One path at one row count: GOP/s over a layer's linears (median, and every rep), and
    at few rows the weight bytes it read a second (GB/s) and that over the read bandwidth."""

    path: str
    rows: int
    gops_p50: float
    gops: list[float]
    weight_gbps: float
    bandwidth_share: float


def layer_shapes(shape: str = "tinyllama-1.1b") -> list[tuple[str, int, int]]:
    """A layer's linears of `shape` as (name, N, K), q/k/v and gate/up fused as served."""
    c = SHAPES[shape]
    hidden, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    head_dim = hidden // int(c["num_attention_heads"])
    qkv = hidden + 2 * int(c["num_key_value_heads"]) * head_dim
    return [
        ("qkv", qkv, hidden),
        ("o", hidden, hidden),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]


@register("kernels")
def run_kernels(run: BenchRun) -> dict[str, list[RunResult]]:
    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    paths = _paths()
    rows = [row for m in tqdm(ROWS, desc="kernels") for row in _measure(paths, m, bandwidth)]
    _print(rows)
    perf = _beside_ggml()
    bench = _llama_bench()
    run.write(
        "kernels",
        {
            "workload": "kernels",
            "shape": "tinyllama-1.1b",
            "linears": layer_shapes(),
            "read_bandwidth_gbps": bandwidth / 1e9,
            "threads": torch.get_num_threads(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "results": [asdict(r) for r in rows],
            "ggml_perf_shape": PERF_SHAPE,
            "ggml_mul_mat": [asdict(r) for r in perf],
            "llama_bench": bench,
        },
    )
    return {}


@dataclass(frozen=True)
class PerfShapeRow:
    """One multiply on ggml's perf shape: `source` (ggml, or a radixrt path) over `rows` rows
    and `kind` weights, GOP/s, at `threads` threads."""

    source: str
    kind: str
    rows: int
    gops: float
    threads: int


def _beside_ggml() -> list[PerfShapeRow]:
    """ggml's MUL_MAT perf cases and radixrt's GEMM on the same shape, kinds, rows and threads
    ([] without test-backend-ops)."""
    ggml = mul_mat()
    if not ggml:
        return []
    threads = perf_threads(os.cpu_count() or 1)
    found = [PerfShapeRow("ggml", r.kind, r.rows, r.gops, threads) for r in ggml]
    found += _ours_on_perf_shape(threads)
    print(f"\nGOP/s on ggml's MUL_MAT perf shape (N x K = {PERF_SHAPE}), {threads} threads:")
    for kind in PERF_TYPES.values():
        for m in PERF_ROWS:
            cells = [f"{r.source} {r.gops:.1f}" for r in found if r.kind == kind and r.rows == m]
            print(f"  {kind} rows {m:>3}: " + ", ".join(cells))
    return found


def _ours_on_perf_shape(threads: int) -> list[PerfShapeRow]:
    """radixrt's GEMM on ggml's perf shape: Q4_0's and Q8_0's groups on each native path, at
    `threads` threads (torch's count restored after), median of REPS after a warm-up."""
    from radixrt.kernels import cpu_isa, int4_gemm
    from radixrt.kernels.cpu_isa import Isa

    n, k = PERF_SHAPE
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02
    weights = {
        "Q4_0": int4_gemm.PackedGroups.quantize(w, int4_gemm.Bits.INT4, symmetric=True),
        "Q8_0": int4_gemm.PackedGroups.quantize(w, int4_gemm.Bits.INT8),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    found = []
    try:
        for isa in (i for i in cpu_isa.host_paths() if i is not Isa.TORCH):
            for kind, packed in weights.items():
                for m in PERF_ROWS:
                    x = torch.randn(m, k)
                    times = []
                    for _ in range(REPS + 1):
                        start = time.perf_counter()
                        int4_gemm.grouped_linear(x, packed, None, isa)
                        times.append(time.perf_counter() - start)
                    gops = 2 * m * n * k / statistics.median(times[1:]) / 1e9
                    found.append(PerfShapeRow(isa.value, kind, m, gops, threads))
    finally:
        torch.set_num_threads(before)
    return found


def _llama_bench() -> dict[str, Any]:
    """llama-bench on the 1.1B shape's Q4_0 GGUF at torch's thread count, each prompt's speed
    also as GOP/s of the model's linears ({} where the file or the binary is missing)."""
    gguf = gguf_path("tinyllama-1.1b", "Q4_0")
    if not gguf.is_file():
        print(f"llama-bench skipped: {gguf} not made (radixrt bench --model-shape tinyllama-1.1b)")
        return {}
    threads = torch.get_num_threads()
    rows = llama_bench(gguf, threads)
    c = SHAPES["tinyllama-1.1b"]
    params = int(c["num_hidden_layers"]) * sum(n * k for _, n, k in layer_shapes())
    from transformers import AutoConfig

    from radixrt.executor.model_loader import resolve_model_path

    params += AutoConfig.from_pretrained(resolve_model_path("default")).vocab_size * int(
        c["hidden_size"]
    )  # lm_head (the shape has the default model's vocabulary)
    print(f"\nllama-bench, 1.1B shape Q4_0, {threads} threads:")
    for r in rows:
        gops = (
            f", {2 * params * r.tokens_per_s / 1e9:.1f} GOP/s of linears"
            if r.test[:2] == "pp"
            else ""
        )
        print(f"  {r.test}: {r.tokens_per_s:.1f} tok/s (sd {r.stddev:.1f}){gops}")
    return {
        "gguf": str(gguf),
        "threads": threads,
        "linear_params": params,
        "rows": [asdict(r) for r in rows],
    }


def read_bandwidth() -> float:
    """Bytes a second the host reads from memory with every thread (median of REPS passes
    over a buffer far past the caches)."""
    from radixrt.kernels import native

    lib = native.load(
        "read_bandwidth",
        native.AVX2_PRELUDE + READ_SOURCE,
        (("read_sum", (native.POINTER, native.INT64)),),
    )
    lib.read_sum.restype = native.FLOAT
    x = torch.ones(BANDWIDTH_BYTES // 4)
    times = []
    for _ in range(REPS + 1):
        start = time.perf_counter()
        lib.read_sum(x.data_ptr(), x.numel())
        times.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(times[1:])  # the first pass faults pages in


@dataclass(frozen=True)
class Path:
    """A way to multiply one layer: `run(layer, m)` multiplies every linear of `layer` by
    random rows; `nbytes` is what the layers' weights read."""

    name: str
    layers: list[list[Any]]  # per layer, its weights (any layout `run` takes)
    run: Runner
    nbytes: int


def _paths() -> list[Path]:
    """This host's paths over LAYERS layers of random int4 weights: the baseline, then each
    `--cpu-isa` path it runs."""
    from radixrt.bench.kernel_baseline import Tile4Weight, tile4_linear
    from radixrt.kernels import cpu_isa, int4_gemm
    from radixrt.kernels.cpu_isa import Isa

    gen = torch.Generator().manual_seed(0)
    layers = [
        [
            int4_gemm.PackedGroups.quantize(torch.randn(n, k, generator=gen) * 0.02)
            for _, n, k in layer_shapes()
        ]
        for _ in range(LAYERS)
    ]
    nbytes = sum(w.nbytes for layer in layers for w in layer)
    found = []
    for isa in cpu_isa.host_paths():
        if isa is Isa.AVX2:
            old = [[Tile4Weight.of(w) for w in layer] for layer in layers]
            found.append(Path("avx2 (before: 4-row tiles)", old, _each(tile4_linear), nbytes))
        if isa is not Isa.TORCH:
            linear = partial(_native, isa=isa)
            found.append(Path(isa.value, layers, _each(linear), nbytes))
        else:
            dequantized = lambda x, w: torch.nn.functional.linear(x, w.dequantize())  # noqa: E731
            one = sum(w.nbytes for w in layers[0])
            found.append(Path(isa.value, layers[:1], _each(dequantized), one))
    return found


def _native(x: torch.Tensor, w: Any, isa: Any) -> Any:
    from radixrt.kernels import int4_gemm

    return int4_gemm.grouped_linear(x, w, None, isa)


def _each(linear: Callable[[torch.Tensor, Any], Any]) -> Runner:
    """`linear(x, w)` over a layer's weights, x the rows of each weight's input width."""

    def run(layer: list[Any], xs: dict[int, torch.Tensor]) -> None:
        for w in layer:
            linear(xs[w.in_features], w)

    return run


def _measure(paths: list[Path], m: int, bandwidth: float) -> list[KernelRow]:
    """Every path at `m` rows, alternated rep by rep (one warm-up pass each first)."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for _, _, k in layer_shapes()}
    layer_ops = sum(2 * m * n * k for _, n, k in layer_shapes())
    cycled = {p.name: p.layers if m <= FEW_ROWS else p.layers[:1] for p in paths}
    times: dict[str, list[float]] = {p.name: [] for p in paths}
    for rep in range(REPS + 1):
        for p in paths:
            start = time.perf_counter()
            for layer in cycled[p.name]:
                p.run(layer, xs)
            if rep:
                times[p.name].append(time.perf_counter() - start)
    rows = []
    for p in paths:
        layers = len(cycled[p.name])
        ops, nbytes = layers * layer_ops, p.nbytes * layers // len(p.layers)
        t = statistics.median(times[p.name])
        rows.append(
            KernelRow(
                p.name,
                m,
                ops / t / 1e9,
                [ops / s / 1e9 for s in times[p.name]],
                nbytes / t / 1e9,
                nbytes / t / bandwidth,
            )
        )
    return rows


def _print(rows: list[KernelRow]) -> None:
    paths = list(dict.fromkeys(r.path for r in rows))
    print(f"\nGOP/s, one 1.1B layer's linears ({', '.join(paths)}):")
    print(f"{'rows':>5} " + " ".join(f"{p:>28}" for p in paths))
    for m in ROWS:
        cells = [r for r in rows if r.rows == m]
        print(f"{m:>5} " + " ".join(f"{r.gops_p50:>28.1f}" for r in cells))
    for r in rows:
        if r.rows == 1:
            print(
                f"{r.path}: weights read at {r.weight_gbps:.1f} GB/s at one row, "
                f"{100 * r.bandwidth_share:.0f}% of the read bandwidth"
            )
