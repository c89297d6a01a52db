"""`radixrt bench --workload gpu-check`: the Triton attention kernels and the engine on a CUDA
device (sized for one H200, well under 8 minutes); `--gpu-sections` picks sections (e.g.
check_kv_quant; none: all). Run by its suite, `radixrt.bench.suites.gpu_check`.

(a) correctness against the torch references on realistic bf16 shapes, (b) speed: decode HBM bandwidth and
extend TFLOP/s against dense torch SDPA, plus small launch-config sweeps, (c) end to end: greedy outputs of
radixrt.Engine with the triton and torch attention backends, (d) decode steps at batch 1 and 32 replayed
from CUDA graphs against eager launches: time per step, and where greedy outputs first differ, (e) speculative
decoding against plain decoding, (f) the host tier: copy bandwidth and load-backs end to end, (g) the engine at
tp_size=1 on CUDA, and 2 over two GPUs where the machine has them, (h) each model family's greedy tokens
on CUDA against transformers, (i) the deterministic mode's Triton layout (`FIXED_KV_SPLITS`
splits per row): each row's output bitwise the same in a batch of 32 mixed rows as alone, (j) the
quantized KV pool (`--kv-cache-dtype`) on the Triton kernels and the engine: correctness, decode
time at 2k and 8k keys and the store's against bf16 KV, greedy tokens against bf16 KV, (k) packed
weights on the Triton GEMM (`--quantization int4/int8`, pre-quantized checkpoints): against
dequantize + matmul at llama3-8b's linears, timed against the bf16 matmul, and a GPTQ checkpoint
loaded on CUDA against the CPU's paths. Writes gpu_check.json and gpu_check.txt under
`--output-dir`, rewritten after every section so a timeout still leaves the finished parts.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from radixrt import kernels
from radixrt.bench.config import GPU_CHECK_SECTIONS

if TYPE_CHECKING:
    from radixrt.client.base import Prompt, Results
    from radixrt.engine.request import Req
    from radixrt.engine.scheduler import Scheduler
    from radixrt.executor.model_runner import ModelRunner
    from radixrt.mem_cache.kv_quant import KVFormat

HBM_BYTES_PER_S = 4.8e12  # H200
MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (Hq, Hkv, D)
DEVICE, DTYPE = "cuda", torch.bfloat16
ATOL, RTOL = 1e-2, 2e-2
# Correctness: extend (prefix lens, extend lens); decode: random contexts up to 4k plus a few long ones.
CHECK_EXTEND = ([0, 1000, 30000, 5000, 0], [2048, 1, 777, 1500, 1])
CHECK_DECODE = (252, 4096, [32768, 32767, 20000, 1])
DECODE_SHAPES = [(64, 4096), (256, 2048), (8, 32768), (1, 8192)]  # (batch, ctx)
DECODE_SPLITS = [4, 8, 16, 32]
EXTEND_SHAPES = [(8, 0, 2048), (2, 0, 8192), (8, 4096, 512)]  # (batch, prefix, extend)
SWEEP_DECODE_SHAPE, SWEEP_EXTEND_SHAPE = (64, 4096), (8, 2048)
SWEEP_DEADLINE_S = 300  # skip the config sweeps if the run is already this far in

OUT = Path(".")  # where `save` writes: `run`'s `out_dir`
START = time.time()
results: dict[str, Any] = {}  # the report (gpu_check.json)
lines: list[str] = []
# a kernel call's inputs by argument name: tensors (a quantized pool's rows for the K/V buffers)
# and max_len_extend
Batch: TypeAlias = dict[str, Any]


def log(line: str = "") -> None:
    print(f"[{time.time() - START:6.1f}s] {line}", flush=True)
    lines.append(line)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=2))
    (OUT / "gpu_check.txt").write_text("\n".join(lines) + "\n")


def indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)


def paged_batch(hq: int, hkv: int, d: int, prefix_lens: list[int], extend_lens: list[int]) -> Batch:
    """Extend inputs: prefixes scattered over a KV pool in random slot order, new tokens packed.
    A decode batch is the same with extend_lens all 1, using q_extend as q and prefix_lens as the context."""
    total = sum(prefix_lens)
    pool = total + 1024
    n = sum(extend_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=DTYPE, device=DEVICE)

    return dict(
        q_extend=rand(n, hq, d),
        k_extend=rand(n, hkv, d),
        v_extend=rand(n, hkv, d),
        k_buffer=rand(pool, hkv, d),
        v_buffer=rand(pool, hkv, d),
        qo_indptr=indptr(extend_lens),
        kv_indptr=indptr(prefix_lens),
        kv_indices=torch.randperm(pool, device=DEVICE)[:total].to(torch.int32),
        max_len_extend=max(extend_lens),
    )


def run_extend(
    fn: Callable[..., object], b: Batch, logit_cap: float = 0.0, **options: Any
) -> torch.Tensor:
    o = torch.empty_like(b["q_extend"])
    fn(
        b["q_extend"],
        b["k_extend"],
        b["v_extend"],
        o,
        b["k_buffer"],
        b["v_buffer"],
        b["qo_indptr"],
        b["kv_indptr"],
        b["kv_indices"],
        b["max_len_extend"],
        logit_cap=logit_cap,
        **options,
    )
    return o


def run_decode(
    fn: Callable[..., object],
    b: Batch,
    num_kv_splits: int = 8,
    logit_cap: float = 0.0,
    **options: Any,
) -> torch.Tensor:
    o = torch.empty_like(b["q_extend"])
    fn(
        b["q_extend"],
        b["k_buffer"],
        b["v_buffer"],
        o,
        b["kv_indptr"],
        b["kv_indices"],
        num_kv_splits=num_kv_splits,
        logit_cap=logit_cap,
        **options,
    )
    return o


def compare(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= ATOL + RTOL * ref.float().abs()).all())
    results["correctness"][name] = {"max_abs_err": err.max().item(), "ok": ok}
    log(f"  {name:<58} max|err| {err.max().item():.2e}  {'ok' if ok else 'FAIL'}")


def check_correctness() -> None:
    log("== (a) correctness vs torch reference (bf16) ==")
    results["correctness"] = {}
    gen = torch.Generator().manual_seed(0)
    for model, (hq, hkv, d) in MODELS.items():
        # Extend: prefix 0 and long prefixes, extend lengths from 1 up; the reference materializes the scores.
        prefix, extend = CHECK_EXTEND
        b = paged_batch(hq, hkv, d, prefix, extend)
        for cap in (0.0, 2.0):
            compare(
                f"extend {model} prefix={prefix} extend={extend} cap={cap}",
                run_extend(kernels.extend_attention_fwd, b, cap),
                run_extend(kernels.extend_attention_ref, b, cap),
            )
        num_random, max_ctx, long_ctx = CHECK_DECODE
        ctx = torch.randint(1, max_ctx + 1, (num_random,), generator=gen).tolist() + long_ctx
        b = paged_batch(hq, hkv, d, ctx, [1] * len(ctx))
        ref = run_decode(kernels.decode_attention_ref, b)
        for splits in (1, 8, 32):
            compare(
                f"decode {model} batch={len(ctx)} ctx<={max(ctx)} splits={splits}",
                run_decode(kernels.decode_attention_fwd, b, splits),
                ref,
            )
        compare(
            f"decode {model} batch={len(ctx)} ctx<={max(ctx)} splits=8 cap=2.0",
            run_decode(kernels.decode_attention_fwd, b, 8, 2.0),
            run_decode(kernels.decode_attention_ref, b, 8, 2.0),
        )
        del b, ref
    torch.cuda.empty_cache()


def bench_ms(fn: Callable[[], object]) -> float:
    ms: float = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms


class Tunable(Protocol):
    """A kernel module whose launch config (of the head size) `sweep` patches."""

    _launch_config: Callable[[int], dict[str, int]]


def sweep(
    module: Tunable, configs: list[dict[str, int]], fn: Callable[[], object]
) -> list[dict[str, Any]]:
    """Time fn under each launch config by patching module._launch_config; configs that fail to compile are recorded as errors."""
    rows: list[dict[str, Any]] = []
    original = module._launch_config
    try:
        for cfg in configs:

            def config(block_d: int, cfg: dict[str, int] = cfg) -> dict[str, int]:
                return dict(cfg)

            module._launch_config = config
            try:
                rows.append({**cfg, "ms": bench_ms(fn)})
            except Exception as e:  # e.g. out of shared memory
                rows.append({**cfg, "error": repr(e)[:200]})
    finally:
        module._launch_config = original
    return rows


def bench_decode() -> None:
    log("== (b1) decode: K/V bytes read / time, against %.1f TB/s ==" % (HBM_BYTES_PER_S / 1e12))
    results["decode_bench"] = []
    log(f"  {'model':<10} {'batch':>5} {'ctx':>6} {'splits':>6} {'us':>9} {'TB/s':>6} {'%HBM':>6}")
    for model, (hq, hkv, d) in MODELS.items():
        for batch, ctx in DECODE_SHAPES:
            b = paged_batch(hq, hkv, d, [ctx] * batch, [1] * batch)
            kv_bytes = 2 * batch * ctx * hkv * d * b["k_buffer"].element_size()
            for splits in DECODE_SPLITS:
                o = torch.empty_like(b["q_extend"])
                ms = bench_ms(
                    lambda: kernels.decode_attention_fwd(
                        b["q_extend"],
                        b["k_buffer"],
                        b["v_buffer"],
                        o,
                        b["kv_indptr"],
                        b["kv_indices"],
                        splits,
                    )
                )
                bw = kv_bytes / (ms * 1e-3)
                row = dict(
                    model=model,
                    batch=batch,
                    ctx=ctx,
                    splits=splits,
                    us=ms * 1e3,
                    tb_s=bw / 1e12,
                    frac_hbm=bw / HBM_BYTES_PER_S,
                )
                results["decode_bench"].append(row)
                log(
                    f"  {model:<10} {batch:>5} {ctx:>6} {splits:>6} {ms * 1e3:>9.1f} {bw / 1e12:>6.2f} "
                    f"{100 * bw / HBM_BYTES_PER_S:>5.1f}%"
                )
            del b
    best = max(
        (
            r
            for r in results["decode_bench"]
            if r["model"] == "llama3-8b" and (r["batch"], r["ctx"]) == DECODE_SHAPES[0]
        ),
        key=lambda r: r["frac_hbm"],
    )
    results["decode_target"] = {"best": best, "target_frac": 0.7, "met": best["frac_hbm"] >= 0.7}
    log(
        f"  target llama3-8b {DECODE_SHAPES[0]} >= 70% HBM: best {100 * best['frac_hbm']:.1f}% "
        f"(splits={best['splits']}) -> {'MET' if best['frac_hbm'] >= 0.7 else 'NOT MET'}"
    )
    torch.cuda.empty_cache()


def causal_flops(batch: int, hq: int, d: int, prefix: int, extend: int) -> float:
    # QK^T and PV over the visible (query, key) pairs: the whole prefix plus the causal triangle.
    pairs = extend * prefix + extend * (extend + 1) / 2
    return 4 * batch * hq * d * pairs


def bench_extend() -> None:
    log("== (b2) extend: TFLOP/s vs dense causal torch SDPA (same shapes, prefix 0) ==")
    results["extend_bench"] = []
    log(
        f"  {'model':<10} {'batch':>5} {'prefix':>6} {'extend':>6} {'triton TF/s':>11} {'sdpa TF/s':>9} {'ratio':>6}"
    )
    for model, (hq, hkv, d) in MODELS.items():
        for batch, prefix, extend in EXTEND_SHAPES:
            b = paged_batch(hq, hkv, d, [prefix] * batch, [extend] * batch)
            o = torch.empty_like(b["q_extend"])
            args = (
                b["q_extend"],
                b["k_extend"],
                b["v_extend"],
                o,
                b["k_buffer"],
                b["v_buffer"],
                b["qo_indptr"],
                b["kv_indptr"],
                b["kv_indices"],
                b["max_len_extend"],
            )
            ms = bench_ms(lambda: kernels.extend_attention_fwd(*args))
            tflops = causal_flops(batch, hq, d, prefix, extend) / (ms * 1e-3) / 1e12
            row = dict(model=model, batch=batch, prefix=prefix, extend=extend, ms=ms, tflops=tflops)
            if prefix == 0:
                # Dense [B, H, L, D] layout with K/V expanded to Hq heads, as SDPA's fast kernels want it.
                q = b["q_extend"].view(batch, extend, hq, d).transpose(1, 2).contiguous()
                k, v = (
                    b[x]
                    .view(batch, extend, hkv, d)
                    .transpose(1, 2)
                    .repeat_interleave(hq // hkv, 1)
                    .contiguous()
                    for x in ("k_extend", "v_extend")
                )
                sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                dense = (
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    .transpose(1, 2)
                    .reshape_as(o)
                )
                kernels.extend_attention_fwd(*args)
                row.update(
                    sdpa_ms=sdpa_ms,
                    sdpa_tflops=tflops * ms / sdpa_ms,
                    ratio=sdpa_ms / ms,
                    max_abs_err_vs_sdpa=(o.float() - dense.float()).abs().max().item(),
                )
                del q, k, v, dense
            results["extend_bench"].append(row)
            sdpa = (
                f"{row['sdpa_tflops']:>9.1f} {row['ratio']:>6.2f}"
                if "ratio" in row
                else f"{'-':>9} {'-':>6}"
            )
            log(f"  {model:<10} {batch:>5} {prefix:>6} {extend:>6} {tflops:>11.1f} {sdpa}")
            del b
    ratios = [r["ratio"] for r in results["extend_bench"] if "ratio" in r]
    results["extend_target"] = {
        "min_ratio": min(ratios),
        "target_ratio": 0.5,
        "met": min(ratios) >= 0.5,
    }
    log(
        f"  target triton/SDPA >= 0.50: min ratio {min(ratios):.2f} -> {'MET' if min(ratios) >= 0.5 else 'NOT MET'}"
    )
    torch.cuda.empty_cache()


def sweep_configs() -> None:
    if time.time() - START > SWEEP_DEADLINE_S:
        log("== (b3) config sweeps skipped: out of time ==")
        return
    log("== (b3) launch-config sweeps, llama3-8b (candidates for the _launch_config defaults) ==")
    hq, hkv, d = MODELS["llama3-8b"]

    batch, ctx = SWEEP_DECODE_SHAPE
    b = paged_batch(hq, hkv, d, [ctx] * batch, [1] * batch)
    o = torch.empty_like(b["q_extend"])
    configs = [
        dict(BLOCK_N=n, num_warps=w, num_stages=s)
        for n in (32, 64, 128)
        for w in (4, 8)
        for s in (1, 2, 3)
    ]
    rows = sweep(
        kernels.decode_attention,
        configs,
        lambda: kernels.decode_attention_fwd(
            b["q_extend"], b["k_buffer"], b["v_buffer"], o, b["kv_indptr"], b["kv_indices"], 8
        ),
    )
    results["decode_sweep"] = rows
    log(
        f"  decode {batch}x{ctx}, splits=8: "
        + ", ".join(
            f"N{r['BLOCK_N']}/w{r['num_warps']}/s{r['num_stages']}={r['ms'] * 1e3:.0f}us"
            if "ms" in r
            else f"N{r['BLOCK_N']}/w{r['num_warps']}/s{r['num_stages']}=err"
            for r in rows
        )
    )
    del b

    batch, extend = SWEEP_EXTEND_SHAPE
    b = paged_batch(hq, hkv, d, [0] * batch, [extend] * batch)
    o = torch.empty_like(b["q_extend"])
    configs = [
        dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
        for m, n, w, s in [
            (128, 64, 8, 2),
            (128, 64, 4, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 32, 4, 2),
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (64, 128, 8, 2),
        ]
    ]
    rows = sweep(
        kernels.extend_attention,
        configs,
        lambda: kernels.extend_attention_fwd(
            b["q_extend"],
            b["k_extend"],
            b["v_extend"],
            o,
            b["k_buffer"],
            b["v_buffer"],
            b["qo_indptr"],
            b["kv_indptr"],
            b["kv_indices"],
            b["max_len_extend"],
        ),
    )
    flops = causal_flops(batch, hq, d, 0, extend)
    results["extend_sweep"] = rows
    log(
        f"  extend {batch}x{extend}: "
        + ", ".join(
            f"M{r['BLOCK_M']}/N{r['BLOCK_N']}/w{r['num_warps']}/s{r['num_stages']}="
            + (f"{flops / (r['ms'] * 1e-3) / 1e12:.0f}TF/s" if "ms" in r else "err")
            for r in rows
        )
    )
    del b
    torch.cuda.empty_cache()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _output_ids(results: Results) -> list[list[int]]:
    """Each prompt's output ids, from a call with a list of prompts (one sample each)."""
    assert isinstance(results, list), "a list of prompts: a list of results"
    return [r["output_ids"] for r in results]


def check_engine() -> None:
    log("== (c) end to end: radixrt.Engine greedy outputs, triton vs torch attention ==")
    try:
        import radixrt as rt

        rt.Engine  # noqa: B018
    except (ImportError, AttributeError) as e:
        results["engine"] = {"skipped": repr(e)}
        log(f"  skipped: {e!r}")
        return
    prompts: list[Prompt] = [
        "The capital of France is",
        "def fibonacci(n):",
        "List three primary colors:",
        "Once upon a time, in a small village,",
    ]
    outputs: dict[str, list[list[int]]] = {}
    try:
        for backend in ("triton", "torch"):
            engine = rt.Engine(model="default", attention_backend=backend, dtype="bfloat16")
            generated = engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0})
            outputs[backend] = _output_ids(generated)
            if hasattr(engine, "shutdown"):
                engine.shutdown()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    except Exception:
        results["engine"] = {"error": traceback.format_exc()}
        log("  FAILED:\n" + traceback.format_exc())
        return
    # bf16 near-ties can legitimately flip a greedy pick, so report where outputs first differ.
    first_diff = [first_difference(a, b) for a, b in zip(outputs["triton"], outputs["torch"])]
    equal = all(i is None for i in first_diff)
    results["engine"] = {"equal": equal, "first_diff_index": first_diff, "outputs": outputs}
    log(f"  greedy outputs equal: {equal}; first differing token per prompt: {first_diff}")


def check_families(backend: str = "triton") -> None:
    """Each family's tiny random checkpoint (tests/executor/test_model_families.py): greedy
    tokens of radixrt.Engine on CUDA in float32, triton attention (and CUDA graphs where the
    family allows them), against transformers' on the CPU."""
    log("== (h) model families: greedy on CUDA (triton, float32) vs transformers ==")
    import tempfile

    import radixrt as rt
    from radixrt.executor.model_loader import resolve_model_path

    root = Path(__file__).resolve().parents[2]  # the checkout: its tests' model families
    sys.path[:0] = [str(root / "tests"), str(root / "tests" / "executor")]
    from test_model_families import FAMILIES, GREEDY, MAX_NEW, _checkpoint, _prompts

    from helpers import hf_greedy

    tokenizer_dir = resolve_model_path("default")
    results["families"] = {}
    for name in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            folder = _checkpoint(Path(tmp), tokenizer_dir, name)
            prompts = _prompts()
            expected = hf_greedy(folder, prompts, MAX_NEW)
            with rt.Engine(
                model=str(folder),
                attention_backend=backend,
                dtype="float32",
                page_size=4,
                log_level="warning",
            ) as engine:
                runs = [
                    _output_ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
                    for _ in ("cold", "warm")
                ]
        diffs = [[first_difference(g, e) for g, e in zip(run, expected)] for run in runs]
        equal = all(d is None for run in diffs for d in run)
        results["families"][name] = {"equal": equal, "first_diff_index": diffs}
        log(f"  {name}: equal {equal}; first differing token (cold, warm): {diffs}")
        save()


def check_tensor_parallel() -> None:
    log("== (g) tensor parallelism: tp_size=1 on this GPU, and 2 over two GPUs where there are ==")
    import radixrt as rt

    prompts: list[Prompt] = ["The capital of France is", "def fibonacci(n):"]
    outputs: dict[int, list[list[int]]] = {}
    sizes = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    for tp in sizes:
        with rt.Engine(model="default", dtype="bfloat16", tp_size=tp) as engine:
            start = time.perf_counter()
            out = engine.generate(
                prompts, {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
            )
            seconds = time.perf_counter() - start
            outputs[tp] = _output_ids(out)
            stats = engine.stats()
        results.setdefault("tensor_parallel", {})[f"tp{tp}"] = {
            "tok_per_s": sum(len(o) for o in outputs[tp]) / seconds,
            "collective_share": stats["tp_collective_time_s"] / max(stats["step_time_s"], 1e-9),
        }
        log(f"  tp_size={tp}: {results['tensor_parallel'][f'tp{tp}']}")
    if 2 in outputs:
        firsts = [first_difference(a, b) for a, b in zip(outputs[1], outputs[2])]
        results["tensor_parallel"]["first_diff"] = firsts
        log(f"  first differing token, tp 2 against 1 (None: equal): {firsts}")
    else:
        log("  one GPU: tp_size=2 skipped")


def timed_decode(scheduler: Scheduler, reqs: list[Req], steps: int = 32) -> float:
    """Run `reqs` (made by `scheduler`) to the end; the mean time of up to `steps` decode steps
    once every prompt is in and while all of them still run, in ms."""
    for req in reqs:
        scheduler.add_request(req)
    while any(r.tokens_to_compute > 1 for r in scheduler.running) or scheduler.waiting:
        scheduler.step()
    torch.cuda.synchronize()
    start, done = time.perf_counter(), 0
    while done < steps and len(scheduler.running) == len(reqs):
        scheduler.step()
        done += 1
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / max(done, 1) * 1e3
    while scheduler.running:
        scheduler.step()
    return ms


def check_cuda_graphs() -> None:
    log("== (d) decode steps replayed from CUDA graphs against eager launches ==")
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler
    from radixrt.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    results["cuda_graphs"] = {}
    outputs = {}
    for batch in (1, 32):
        for disabled in (False, True):
            scheduler = Scheduler.from_server_args(
                ServerArgs(dtype="bfloat16", disable_cuda_graph=disabled, max_running_requests=64)
            )
            assert (scheduler.runner.graph_runner is None) == disabled
            reqs = [
                scheduler.make_request(
                    f"r{i}", [100 + (7 * i + j) % 30000 for j in range(200 + 13 * i)], params
                )
                for i in range(batch)
            ]
            ms = timed_decode(scheduler, reqs)
            outputs[(batch, disabled)] = [r.output_ids for r in reqs]
            key = f"batch{batch}_{'eager' if disabled else 'graphs'}"
            results["cuda_graphs"][key] = {"decode_step_ms": ms}
            log(f"  batch {batch}, {'eager ' if disabled else 'graphs'}: {ms:.2f} ms a decode step")
            del scheduler
            gc.collect()
            torch.cuda.empty_cache()
        firsts = [
            first_difference(a, b) for a, b in zip(outputs[(batch, False)], outputs[(batch, True)])
        ]
        results["cuda_graphs"][f"batch{batch}_first_diff"] = firsts
        log(f"  batch {batch}: first differing token per request (None: equal): {firsts}")


def check_speculative() -> None:
    log(
        "== (e) speculative decoding (ngram drafts, triton extend verification) against plain decoding =="
    )
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler
    from radixrt.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": 96, "temperature": 0, "ignore_eos": True})
    calls = "".join(
        f'Step {i}:\nCall: {{"tool": "weather", "arguments": {{"city": "{c}"}}}}\nObservation: ok\n'
        for i, c in enumerate(["Lisbon", "Oslo", "Quito", "Perth"])
    )
    results["speculative"] = {}
    outputs = {}
    for algorithm in ("ngram", None):
        scheduler = Scheduler.from_server_args(
            ServerArgs(dtype="bfloat16", speculative_algorithm=algorithm)
        )
        ids = scheduler.tokenizer.encode(calls + "Step 4:\n", add_special_tokens=False)
        reqs = [scheduler.make_request(f"r{i}", ids, params) for i in range(2)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for req in reqs:  # one after the other: the second drafts from the first
            scheduler.add_request(req)
            while scheduler.has_work():
                scheduler.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        outputs[algorithm] = [r.output_ids for r in reqs]
        stats = scheduler.stats()
        name = algorithm or "off"
        results["speculative"][name] = {
            "tok_per_s": sum(len(r.output_ids) for r in reqs) / seconds,
            "accept_length": stats["spec_accept_length"],
            "forward_steps": stats["forward_steps"],
        }
        log(f"  {name}: {results['speculative'][name]}")
        scheduler.check_invariants()
        del scheduler
        gc.collect()
        torch.cuda.empty_cache()
    firsts = [first_difference(a, b) for a, b in zip(outputs["ngram"], outputs[None])]
    results["speculative"]["first_diff"] = firsts
    log(f"  first differing token per request (None: equal): {firsts}")


def check_hicache() -> None:
    log(
        "== (f) host tier: pinned copies between the pool and host memory; load-backs end to end =="
    )
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler
    from radixrt.sampling_params import SamplingParams

    results["hicache"] = {}
    outputs = {}
    params = SamplingParams.from_dict({"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    for tier in (True, False):
        scheduler = Scheduler.from_server_args(
            ServerArgs(
                dtype="bfloat16",
                max_total_tokens=4096,
                enable_hierarchical_cache=tier,
                hicache_write_policy="write_back",
            )
        )
        if tier:  # copy bandwidth of the host pool, both directions
            host = scheduler.kv.host
            assert host is not None, "enable_hierarchical_cache: a host tier"
            n = 2048
            host_slots = host.alloc(n)
            assert host_slots is not None, "the host pool holds a 2048-token copy"
            device_slots = torch.arange(1, n + 1, device="cuda")
            per_token = sum(
                b[0].numel() * b.element_size() for b in host.k_buffers + host.v_buffers
            )
            for name, copy in (
                ("write", lambda: host.write(host_slots, device_slots)),
                ("load", lambda: host.load(device_slots, host_slots)),
            ):
                ms = do_bench(copy, warmup=3, rep=20)
                results["hicache"][f"{name}_GBps"] = n * per_token / ms / 1e6
            host.free(host_slots)
        gen = torch.Generator().manual_seed(0)
        histories = [torch.randint(3, 40000, (1500,), generator=gen).tolist() for _ in range(6)]
        outs = []
        for turn in range(2):  # six 1500-token histories through a 4096-token pool, twice
            for i, history in enumerate(histories):
                req = scheduler.make_request(f"t{turn}-{i}", history + [7 + turn], params)
                scheduler.add_request(req)
                while scheduler.has_work():
                    scheduler.step()
                outs.append(req.output_ids)
        outputs[tier] = outs
        scheduler.check_invariants()
        stats = scheduler.stats()
        name = "tier" if tier else "no-tier"
        results["hicache"][name] = {
            k: stats[k] for k in ("cache_hit_rate", "host_hit_tokens", "evicted_tokens")
        }
        log(f"  {name}: {results['hicache'][name]}")
        del scheduler
        gc.collect()
        torch.cuda.empty_cache()
    firsts = [first_difference(a, b) for a, b in zip(outputs[True], outputs[False])]
    results["hicache"]["first_diff"] = firsts
    log(f"  copies: { ({k: v for k, v in results['hicache'].items() if k.endswith('GBps')}) }")
    log(f"  first differing token per request, tier against none (None: equal): {firsts}")


def check_fused_moe() -> None:
    """The fused MoE kernel on CUDA against the grouped experts (the CPU's path, run here on the
    GPU too) at a Mixtral-like layer (hidden 4096, 8 experts of 14336, top 2): equality in
    float32, and both paths' time at 1, 32 and 512 tokens in bfloat16."""
    log("== (i) fused MoE: Triton kernel vs grouped experts (Mixtral-like layer) ==")
    from radixrt.distributed.group import TPGroup
    from radixrt.models.family import MoeSpec
    from radixrt.models.moe import SparseMoE, grouped_experts, route

    names = ("gate_proj", "up_proj", "down_proj")
    spec = MoeSpec(8, 2, 14336, True, "mlp", names, frozenset())
    results["fused_moe"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        moe = SparseMoE(4096, spec, 14336, TPGroup(), "silu").to("cuda", dtype)
        for param in moe.parameters():
            torch.nn.init.normal_(param, std=0.02)
        for tokens in (1, 32, 512):
            x = torch.randn(tokens, 4096, device="cuda", dtype=dtype)
            with torch.no_grad():
                routing = route(moe.gate(x), 2, renormalize=True)
                fused = moe.fused(x, routing)
                grouped = grouped_experts(x, routing, moe.experts)
                err = (fused.float() - grouped.float()).abs().max().item()
                row = {"max_abs_err": err}
                if dtype == torch.bfloat16:
                    row["fused_ms"] = bench_ms(lambda: moe.fused(x, routing))
                    row["grouped_ms"] = bench_ms(lambda: grouped_experts(x, routing, moe.experts))
            results["fused_moe"][f"{str(dtype).removeprefix('torch.')}-{tokens}"] = row
            log(f"  {dtype} tokens {tokens}: {row}")
        save()


def check_deterministic_rows() -> None:
    """(i) `--enable-deterministic-inference`'s Triton attention: every row a decode row with
    FIXED_KV_SPLITS splits; a row's output in a batch of 32 mixed contexts (1 to 6000 keys) equals,
    bit for bit, the row computed alone, for each model shape."""
    from radixrt.attention.triton_backend import FIXED_KV_SPLITS

    results["deterministic_rows"] = {}
    for name, (hq, hkv, d) in MODELS.items():
        torch.manual_seed(0)
        lens = [1, 7, 64, 65, 500, 6000] + [int(x) for x in torch.randint(1, 3000, (26,))]
        b = paged_batch(hq, hkv, d, lens, [1] * len(lens))
        together = run_decode(kernels.decode_attention_fwd, b, FIXED_KV_SPLITS)
        differing = 0
        for i, n in enumerate(lens):
            start = int(b["kv_indptr"][i])
            alone = {
                **b,
                "q_extend": b["q_extend"][i : i + 1],
                "kv_indptr": indptr([n]),
                "kv_indices": b["kv_indices"][start : start + n],
            }
            out = run_decode(kernels.decode_attention_fwd, alone, FIXED_KV_SPLITS)
            differing += not torch.equal(out[0], together[i])
        results["deterministic_rows"][name] = {"rows": len(lens), "differing": differing}
        log(f"  deterministic rows {name}: {differing} of {len(lens)} differ alone vs batched")
    save()


KV_CHECK_CTX = [1, 77, 2048, 8192, 20000]  # decode contexts of the correctness check
KV_DECODE_SHAPES = [(1, 2048), (1, 8192), (32, 2048), (32, 8192)]  # (batch, ctx)
KV_ENGINE_PROMPTS = [(4, 2000), (1, 8000)]  # (requests, prompt tokens): 2k and 8k contexts


def quantized_pool(b: Batch, fmt: KVFormat) -> tuple[Batch, Batch]:
    """`b` with its K/V pool as `fmt`'s quantized rows, and `b` with the bf16 values those rows
    hold (what the kernels must attend over)."""
    rows = {x: fmt.quantize(b[x]) for x in ("k_buffer", "v_buffer")}
    return {**b, **rows}, {**b, **{x: fmt.dequantize(r, DTYPE) for x, r in rows.items()}}


def check_kv_quant() -> None:
    """(j) `--kv-cache-dtype` on the Triton path: both kernels over each format's rows against
    the reference on the values they hold (and how far those move the output from the bf16
    pool's); decode kernel time at 2k and 8k keys against a bf16 pool; the store's time
    (`check_kv_store`); the engine on the default
    model (bf16, triton, CUDA graphs) with fp8_e4m3 and int8 KV against bf16 KV: a decode step at
    2k and 8k contexts, and where greedy tokens first differ."""
    from radixrt.mem_cache.kv_quant import KVFormat

    log("== (j) quantized KV (--kv-cache-dtype) on the Triton kernels and the engine ==")
    out: dict[str, Any] = {"kernels": {}, "decode_us": [], "engine": {}}
    results["kv_quant"] = out
    results.setdefault("correctness", {})  # compare() records there: failures count in the summary
    for model, (hq, hkv, d) in MODELS.items():
        prefix, extend = CHECK_EXTEND
        ext = paged_batch(hq, hkv, d, prefix, extend)
        dec = paged_batch(hq, hkv, d, KV_CHECK_CTX, [1] * len(KV_CHECK_CTX))
        cases: list[tuple[str, Batch, Callable[..., torch.Tensor], Any, Any]] = [
            ("extend", ext, run_extend, kernels.extend_attention_fwd, kernels.extend_attention_ref),
            ("decode", dec, run_decode, kernels.decode_attention_fwd, kernels.decode_attention_ref),
        ]
        for name, b, run, fwd, ref in cases:
            bf16_pool_out = run(ref, b)
            for fmt in KVFormat:
                stored, values = quantized_pool(b, fmt)
                got = run(fwd, stored, kv_kind=fmt.kernel_kind)
                compare(f"{name} {model} {fmt.value} KV", got, run(ref, values))
                moved = (got.float() - bf16_pool_out.float()).abs().max().item()
                out["kernels"][f"{name} {model} {fmt.value}"] = {"max_abs_vs_bf16_pool": moved}
                log(f"    vs the bf16 pool's output: max|diff| {moved:.2e}")
                del stored, values
        del ext, dec, cases
    save()
    log(f"  {'model':<10} {'batch':>5} {'ctx':>6} {'KV':>9} {'us':>9} {'x bf16':>7}")
    for model, (hq, hkv, d) in MODELS.items():
        for batch, ctx in KV_DECODE_SHAPES:
            b = paged_batch(hq, hkv, d, [ctx] * batch, [1] * batch)
            pools: dict[str, tuple[Batch, dict[str, int]]] = {"bf16": (b, {})}
            pools.update(
                {f.value: (quantized_pool(b, f)[0], {"kv_kind": f.kernel_kind}) for f in KVFormat}
            )
            base = None
            for kv, (pool, kind) in pools.items():
                us = 1e3 * bench_ms(lambda: run_decode(kernels.decode_attention_fwd, pool, **kind))
                base = base or us
                out["decode_us"].append(dict(model=model, batch=batch, ctx=ctx, kv=kv, us=us))
                log(f"  {model:<10} {batch:>5} {ctx:>6} {kv:>9} {us:>9.1f} {base / us:>7.2f}")
            del b, pools
        torch.cuda.empty_cache()
    check_kv_store(out)
    save()
    check_kv_quant_engine(out["engine"])


def check_kv_store(out: dict[str, Any]) -> None:
    """(j, the store) `TokenToKVPool.set_kv` into one layer of llama3-8b's KV heads, a decode
    batch's tokens and a prefill's: the quantized pools quantize in torch (several launches a
    call, no fused kernel yet), so this says whether the store is worth fusing."""
    from radixrt.mem_cache.kv_quant import parse_kv_format
    from radixrt.mem_cache.memory_pool import TokenToKVPool

    _, hkv, d = MODELS["llama3-8b"]
    out["set_kv_us"] = []
    for tokens in (32, 2048):
        k, v = (torch.randn(tokens, hkv, d, dtype=DTYPE, device=DEVICE) for _ in range(2))
        slots = torch.randperm(8192, device=DEVICE)[:tokens]
        for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
            fmt = parse_kv_format(kv)
            pool = TokenToKVPool(8192, 1, hkv, d, DTYPE, torch.device(DEVICE), fmt)
            us = 1e3 * bench_ms(lambda: pool.set_kv(0, slots, k, v))
            out["set_kv_us"].append({"tokens": tokens, "kv": kv, "us": us})
            log(f"  set_kv {tokens:>5} tokens, {kv:>8} KV: {us:8.1f} us")


def check_kv_quant_engine(out: dict[str, Any]) -> None:
    """(j, end to end) the default model with each KV dtype: decode step time and greedy tokens
    at each of KV_ENGINE_PROMPTS, against `auto` (bf16)."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler
    from radixrt.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    gen = torch.Generator().manual_seed(0)
    prompts = {
        shape: [
            torch.randint(3, 40000, (shape[1],), generator=gen).tolist() for _ in range(shape[0])
        ]
        for shape in KV_ENGINE_PROMPTS
    }
    tokens: dict[tuple[str, int, int], list[list[int]]] = {}
    for kv in ("auto", "fp8_e4m3", "int8"):
        scheduler = Scheduler.from_server_args(ServerArgs(dtype="bfloat16", kv_cache_dtype=kv))
        for (n, length), batch in prompts.items():
            reqs = [scheduler.make_request(f"{kv}-{n}-{i}", p, params) for i, p in enumerate(batch)]
            ms = timed_decode(scheduler, reqs)
            tokens[kv, n, length] = [r.output_ids for r in reqs]
            row: dict[str, Any] = {"decode_step_ms": ms}
            if kv != "auto":
                pairs = zip(tokens[kv, n, length], tokens["auto", n, length])
                row["first_diff"] = [first_difference(a, b) for a, b in pairs]
            out[f"{kv} {n}x{length}"] = row
            log(f"  engine {kv:>8} {n} x {length} tokens: {row}")
        del scheduler
        gc.collect()
        torch.cuda.empty_cache()


# llama3-8b's linears (outputs, inputs); rows: decode batches and prefill chunks
PACKED_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
PACKED_CHECK_ROWS = [1, 77, 2048]
PACKED_BENCH_ROWS = [1, 16, 256, 2048]
PACKED_IDS = 256  # teacher-forced positions of the checkpoint check


def packed_formats(n: int, k: int) -> dict[str, Any]:
    """A random weight [n, k] (on the CPU) in each packed format the GEMM reads."""
    from radixrt.kernels.int4_gemm import Bits, PackedGroups
    from radixrt.kernels.int8_gemm import PackedInt8

    w = torch.randn(n, k) / k**0.5
    return {
        "int4": PackedGroups.quantize(w),
        "groups8": PackedGroups.quantize(w, Bits.INT8),
        "int8": PackedInt8.quantize(w),
    }


def check_packed_gemm() -> None:
    """(k) `kernels/packed_gemm.py` on the GPU: each packed format of llama3-8b's linears against
    the float32 matmul of its `dequantize()` (bf16 activations, a bias), then its time against
    the bf16 matmul of the same weight at decode and prefill rows, and the packed bytes it
    reads per second; then a GPTQ checkpoint on CUDA (`check_packed_checkpoint`)."""
    from radixrt.kernels.packed_gemm import packed_linear_fwd

    log("== (k) packed weights on the Triton GEMM (--quantization, pre-quantized checkpoints) ==")
    out: dict[str, Any] = {"bench": [], "checkpoint": {}}
    results["packed_gemm"] = out
    results.setdefault("correctness", {})
    log(
        f"  {'linear':<8} {'format':<8} {'rows':>5} {'us':>9} {'bf16 us':>9} {'x bf16':>7} {'GB/s':>7}"
    )
    for shape, (n, k) in PACKED_SHAPES.items():
        for fmt, packed in packed_formats(n, k).items():
            weight = packed.to(DEVICE)
            dense = packed.dequantize().to(DEVICE)
            bias = torch.randn(n, device=DEVICE)
            for m in PACKED_CHECK_ROWS:
                x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
                got = packed_linear_fwd(x, weight, bias)
                compare(
                    f"packed gemm {fmt} {shape} rows={m}", got, F.linear(x.float(), dense, bias)
                )
            nbytes = weight.tiles.nbytes + weight.scales.nbytes
            bf16 = dense.to(DTYPE)
            del dense
            for m in PACKED_BENCH_ROWS:
                x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
                us = 1e3 * bench_ms(lambda: packed_linear_fwd(x, weight, None))
                base = 1e3 * bench_ms(lambda: F.linear(x, bf16))
                row = dict(linear=shape, format=fmt, rows=m, us=us, bf16_us=base)
                row["weight_gb_per_s"] = nbytes / us / 1e3
                out["bench"].append(row)
                log(
                    f"  {shape:<8} {fmt:<8} {m:>5} {us:>9.1f} {base:>9.1f} {base / us:>7.2f} {row['weight_gb_per_s']:>7.0f}"
                )
            del weight, bf16
            torch.cuda.empty_cache()
        save()
    check_packed_checkpoint(out["checkpoint"])


def forced_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """tests/helpers.py's `teacher_forced_logits` on the runner's device: logits [n, V]
    float64 (on the CPU) at every position of `ids`, one prefill over slots 1..n."""
    from radixrt.forward_batch import ForwardBatch

    n, device = len(ids), runner.device
    slots = torch.arange(1, n + 1, device=device)
    runner.req_to_token_pool.req_to_token[1, :n] = slots.to(torch.int32)
    ids_t, positions = torch.tensor(ids, device=device), torch.arange(n, device=device)
    batch = ForwardBatch(ids_t, positions, slots, torch.tensor([1], device=device), [0], [n])
    logits = runner.logits(runner.forward(batch))
    assert logits is not None, "one rank: its logits"
    return logits.double().cpu()


def check_packed_checkpoint(out: dict[str, Any]) -> None:
    """(k, a checkpoint) the default model's first layers as a GPTQ act-order checkpoint
    (tests/quant_packers.py), teacher-forced on CUDA in float32 and bf16 against the CPU's
    dequantized path (`--cpu-isa torch`: float activations, the kernel's numerics) and its C
    kernels (8-bit activations): largest logit gap and top-1 agreement. float32 passes within
    1e-3 of the largest logit; bf16 and the C kernels at 90% top-1."""
    import tempfile

    from radixrt.executor.model_loader import resolve_model_path

    sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "tests")]
    from quant_packers import quality_ids, runner, write_quantized, write_small_model

    with tempfile.TemporaryDirectory() as tmp:
        small = write_small_model(resolve_model_path("default"), Path(tmp) / "small")
        folder = Path(tmp) / "gptq"
        write_quantized(small, folder, "gptq", 128, True, desc_act=True)
        ids = quality_ids(small)[:PACKED_IDS]
        reference = forced_logits(runner(folder, device="cpu", cpu_isa="torch"), ids)
        paths = {"cpu C kernels": forced_logits(runner(folder, device="cpu"), ids)}
        for dtype in ("float32", "bfloat16"):
            on_gpu = runner(
                folder,
                device="cuda",
                dtype=dtype,
                attention_backend="triton",
                disable_cuda_graph=True,
            )
            paths[f"cuda {dtype}"] = forced_logits(on_gpu, ids)
            del on_gpu
            torch.cuda.empty_cache()
    scale = reference.abs().max().item()
    for name, logits in paths.items():
        gap = (logits - reference).abs().max().item()
        top1 = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
        ok = gap <= 1e-3 * scale if name == "cuda float32" else top1 >= 0.9
        out[name] = {"max_abs_gap": gap, "top1": top1, "largest_logit": scale}
        results["correctness"][f"gptq checkpoint {name} vs dequantized"] = {
            "max_abs_err": gap,
            "ok": ok,
        }
        log(
            f"  gptq checkpoint, {name}: max|gap| {gap:.2e} (logits to {scale:.1f}), top-1 {top1:.3f}  {'ok' if ok else 'FAIL'}"
        )


SECTIONS = (
    check_correctness,
    bench_decode,
    bench_extend,
    check_cuda_graphs,
    check_speculative,
    check_hicache,
    check_tensor_parallel,
    sweep_configs,
    check_engine,
    check_families,
    check_fused_moe,
    check_deterministic_rows,
    check_kv_quant,
    check_packed_gemm,
)
assert tuple(s.__name__ for s in SECTIONS) == GPU_CHECK_SECTIONS, "the bench's list is this one"


def run(out_dir: Path, only: set[str]) -> dict[str, Any]:
    """Every section named in `only` (none: every one), in order, a crash recorded and the next
    run; the results (also in `out_dir`, saved after every section)."""
    global OUT, START
    OUT, START = out_dir, time.time()
    results.update(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__
    )
    log(f"device {results['device']}, torch {results['torch']}, triton {results['triton']}")
    for section in SECTIONS:
        if only and section.__name__ not in only:
            continue
        try:
            section()
        except Exception:
            results.setdefault("errors", {})[section.__name__] = traceback.format_exc()
            log(f"  {section.__name__} crashed:\n" + traceback.format_exc())
        save()
    failed = [k for k, v in results.get("correctness", {}).items() if not v["ok"]]
    results["summary"] = {"correctness_failures": failed, "elapsed_s": time.time() - START}
    log(f"done in {time.time() - START:.0f}s; correctness failures: {len(failed)}")
    save()
    return results
