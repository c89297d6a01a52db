"""`radixrt bench`: one workload against radixrt, its baselines and its peers, in one run."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixrt.bench.floors import Floors, MachineRates
from radixrt.bench.load import REPLY_TIMEOUT_S, Load, run_load
from radixrt.bench.metrics import SLO, RequestTrace, Summary, summarize
from radixrt.bench.peers import (
    LLAMA_CPP_MISSING,
    LLAMA_SERVER_MISSING,
    LlamaCppTarget,
    LlamaServerTarget,
    llama_cpp_available,
    llama_server_binary,
    run_transformers,
)
from radixrt.bench.workloads import REQUEST_WORKLOADS, Session, WorkloadConfig

# radixrt configurations compared with each other: name -> server arguments
VARIANTS = {
    "radixrt": {},
    "radixrt-no-cache": {"disable_radix_cache": True},
    "radixrt-static": {"schedule_mode": "static"},
    "radixrt-no-chunking": {"chunked_prefill_size": 0},
    "radixrt-no-jump-forward": {"enable_jump_forward": False},
    "radixrt-int8": {"quantization": "int8"},
    "radixrt-spec": {"speculative_algorithm": "ngram"},
    "radixrt-no-jump-forward-spec": {
        "enable_jump_forward": False,
        "speculative_algorithm": "ngram",
    },
    # the host tier (swap preemption on), under each write policy; and with recompute preemption
    "radixrt-hicache": {"enable_hierarchical_cache": True},
    "radixrt-hicache-write-through": {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_through",
    },
    "radixrt-hicache-write-back": {
        "enable_hierarchical_cache": True,
        "hicache_write_policy": "write_back",
    },
    "radixrt-tp2": {"tp_size": 2},  # two rank processes, a thread each on a 2-core CPU
    # two workers behind the router, a thread each on a 2-core CPU, half the pool each
    "radixrt-dp2": {"dp_size": 2},
    "radixrt-dp2-round-robin": {"dp_size": 2, "router_policy": "round-robin"},
    "radixrt-dp2-shortest-queue": {"dp_size": 2, "router_policy": "shortest-queue"},
    "radixrt-hicache-recompute": {
        "enable_hierarchical_cache": True,
        "preemption_mode": "recompute",
    },
}
LLAMA_PEERS = ("llama.cpp", "llama-server")
PEERS = ("transformers", *LLAMA_PEERS)
MAX_LLAMA_SLOTS = 64
PROGRAM_WORKLOADS = ("agent", "few-shot-select", "tree-of-thought")
DEFAULT_SYSTEMS = {
    "shared-prefix": "radixrt,radixrt-no-cache,radixrt-static,radixrt-int8,transformers,"
    "llama.cpp,llama-server",
    "multi-turn": "radixrt,radixrt-no-cache,llama.cpp,llama-server",
    # ratios over round-robin, the policy cache-aware routing is measured against
    "multi-prefix": "radixrt-dp2,radixrt-dp2-round-robin,radixrt-dp2-shortest-queue,radixrt",
    "long-prompt": "radixrt,radixrt-no-chunking",
    "random": "radixrt,radixrt-no-cache,transformers",
    "json": "radixrt,radixrt-no-jump-forward,radixrt-spec",
    "agent-loop": "radixrt,radixrt-spec",
    "few-shot": "radixrt,radixrt-spec",
    **{w: "radixrt,radixrt-no-cache" for w in PROGRAM_WORKLOADS},
}


@dataclass
class RunResult:
    system: str
    load: str
    request_rate: float | None
    concurrency: int | None
    summary: Summary
    cache_hit_rate: float | None = None  # cached prompt tokens / prompt tokens, over this run
    num_preemptions: int | None = None
    evicted_tokens: int | None = None
    # most KV slots in use at once (the cache is flushed before each load)
    peak_used_tokens: int | None = None
    mask_time_share: float | None = None  # constraint masks / step time
    # speculative decoding: tokens a request got per forward that verified its draft
    spec_accept_length: float | None = None
    tp_collective_share: float | None = None  # rank 0's collectives / its step time
    rank_peak_rss_mb: list[float] | None = None  # each rank process's peak resident memory
    host_hit_tokens: int | None = None  # prompt tokens loaded back from the host tier
    swapped_in_tokens: int | None = None  # retracted requests' tokens loaded back
    floors: Floors | None = None  # the run's compute and weight-read floors, and the shares reached
    by_tag: dict[str, Summary] = field(default_factory=dict)
    # long-prompt: every ITL gap of the short requests
    short_itls: list[float] = field(default_factory=list)


def setup_info(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Everything needed to reproduce or compare a run."""
    import importlib.metadata as md

    import torch

    versions = {}
    for package in (
        "radixrt",
        "torch",
        "transformers",
        "outlines-core",
        "pyzmq",
        "triton",
        "llama-cpp-python",
    ):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "command": "radixrt bench "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k != "func" and v is not None
        ),
        "model": str(model_dir),
        "dtype": args.dtype,
        "max_total_tokens": args.max_total_tokens,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": versions,
        "git_commit": commit,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _radixrt_target(args: argparse.Namespace, system: str, kind: type | None = None):
    """A runtime of `system`'s settings: `kind` (Runtime or Engine), by default the --backend's."""
    from radixrt.client.launcher import Engine, Runtime

    kind = kind or (Runtime if args.backend == "server" else Engine)
    tuned = {"chunked_prefill_size": args.chunked_prefill_size} if args.chunked_prefill_size else {}
    # a fleet shares --max-total-tokens among its workers: every system has the same KV memory
    pool = args.max_total_tokens // VARIANTS[system].get("dp_size", 1)
    return kind(
        model=args.model,
        dtype=args.dtype,
        max_total_tokens=pool,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
        **{"tp_size": args.tp_size, **tuned, **VARIANTS[system]},
    )


def _result(
    system: str,
    load: Load,
    traces: list[RequestTrace],
    duration: float,
    slo: SLO,
    stats_delta: dict[str, float] | None = None,
    limits: tuple[MachineRates, dict[str, Any]] | None = None,
) -> RunResult:
    """`limits`: the machine's rates and the model's weight counts, for the floors."""
    prompt = sum(t.prompt_tokens for t in traces)
    tags = sorted({t.tag for t in traces if t.tag})
    result = RunResult(
        system,
        load.describe(),
        load.request_rate,
        load.concurrency,
        summarize(traces, duration, slo),
        by_tag={tag: summarize([t for t in traces if t.tag == tag], duration, slo) for tag in tags},
        short_itls=[gap for t in traces if t.tag == "short" for gap in t.itls()],
    )
    if len(tags) >= 2 and all(tag.startswith("turn-") for tag in tags):
        later = [t for t in traces if t.tag != "turn-1"]  # the turns that resend a history
        result.by_tag["later turns"] = summarize(later, duration, slo)
    if stats_delta is not None:
        result.cache_hit_rate = sum(t.cached_tokens for t in traces) / max(prompt, 1)
        if stats_delta["tp_collective_time_s"]:
            result.tp_collective_share = stats_delta["tp_collective_time_s"] / max(
                stats_delta["step_time_s"], 1e-9
            )
        if stats_delta["host_hit_tokens"] or stats_delta["swapped_in_tokens"]:
            result.host_hit_tokens = int(stats_delta["host_hit_tokens"])
            result.swapped_in_tokens = int(stats_delta["swapped_in_tokens"])
        result.num_preemptions = int(stats_delta["num_preemptions"])
        result.evicted_tokens = int(stats_delta["evicted_tokens"])
        result.peak_used_tokens = int(stats_delta["peak_used_tokens"])
        if limits is not None:
            result.floors = Floors.of(*limits, stats_delta, duration)
        if stats_delta["spec_verifications"]:
            result.spec_accept_length = (
                1 + stats_delta["spec_accepted_tokens"] / stats_delta["spec_verifications"]
            )
        if stats_delta["constraint_mask_time_s"]:
            result.mask_time_share = stats_delta["constraint_mask_time_s"] / max(
                stats_delta["step_time_s"], 1e-9
            )
    return result


def _stats_delta(before: dict, after: dict) -> dict[str, float]:
    keys = ("num_preemptions", "evicted_tokens", "constraint_mask_time_s", "step_time_s")
    keys += ("forward_steps", "forward_tokens", "attention_pairs", "logit_rows")
    keys += ("spec_verifications", "spec_accepted_tokens", "host_hit_tokens", "swapped_in_tokens")
    keys += ("tp_collective_time_s",)
    return {
        **{k: after[k] - before[k] for k in keys},
        "peak_used_tokens": after["peak_used_tokens"],
    }


def run_system(
    system: str,
    sessions: list[Session],
    loads: list[Load],
    args: argparse.Namespace,
    render,
    tokenizer,
    model_dir: Path,
    slo: SLO,
    machine: MachineRates,
) -> list[RunResult]:
    """One system under each load in turn (a sweep reuses the server, its cache flushed between loads)."""
    if system == "transformers":
        if any(s.chat or len(s.turns) > 1 for s in sessions):
            print("transformers skipped: it runs single-turn raw prompts only")
            return []
        batch = args.concurrency or 64
        result = _result(
            system,
            Load(),
            *run_transformers(model_dir, sessions, tokenizer, args.dtype, batch),
            slo,
        )
        result.load = f"padded batches of {batch}"
        return [result]
    if system in LLAMA_PEERS:
        return _run_llama_peer(system, sessions, loads, args, render, slo)
    results = []
    with _radixrt_target(args, system) as target:
        target.generate("warm up", {"max_new_tokens": 2})
        limits = (machine, target.model_info["weights"])
        for load in loads:
            target.flush_cache()
            before = target.stats()
            traces, duration = run_load(
                target, sessions, load, render, desc=f"{system} ({load.describe()})"
            )
            result = _result(
                system, load, traces, duration, slo, _stats_delta(before, target.stats()), limits
            )
            result.rank_peak_rss_mb = rank_peak_rss_mb(target)
            results.append(result)
    return results


def rank_peak_rss_mb(target) -> list[float] | None:
    """Peak resident memory (Linux VmHWM) of the runtime process and its rank processes (or, for
    a fleet, the router's process and its workers), in MB; None where that cannot be read
    (another OS, a remote server)."""
    import psutil

    proc = getattr(target, "_proc", None)
    if proc is None:
        return None
    server = psutil.Process(proc.pid)
    ranks = [server] + [
        p
        for p in server.children(recursive=True)
        if "spawn_main" in (cmd := " ".join(p.cmdline())) or " radixrt serve " in cmd
    ]
    peaks = []
    for p in ranks:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            return None
        kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        peaks.append(kb / 1024)
    return peaks


def _run_llama_peer(
    system: str,
    sessions: list[Session],
    loads: list[Load],
    args: argparse.Namespace,
    render,
    slo: SLO,
) -> list[RunResult]:
    """llama.cpp through llama-cpp-python (one target for every load), or llama-server started
    for each load with as many slots as that load has requests in flight at most."""
    gguf = _gguf_of(args.model)
    binary = llama_server_binary()
    missing = (
        "the model is not a GGUF file"
        if gguf is None
        else LLAMA_CPP_MISSING
        if system == "llama.cpp" and not llama_cpp_available()
        else LLAMA_SERVER_MISSING
        if system == "llama-server" and binary is None
        else None
    )
    if missing:
        print(f"{system} skipped: {missing}" if gguf is None else missing)
        return []

    def run(target, load: Load) -> RunResult:
        return _result(system, load, *run_load(target, sessions, load, render, desc=system), slo)

    if system == "llama.cpp":
        target = LlamaCppTarget(gguf, threads=os.cpu_count())
        try:
            return [run(target, load) for load in loads]
        finally:
            target.close()
    results = []
    for load in loads:
        slots = min(load.concurrency or len(sessions), MAX_LLAMA_SLOTS)
        target = LlamaServerTarget(binary, gguf, slots, threads=os.cpu_count())
        try:
            result = run(target, load)
        finally:
            target.close()
        result.load = f"{result.load}, {slots} slots"
        results.append(result)
    return results


def _gguf_of(model: str) -> Path | None:
    from radixrt.executor.model_loader import default_gguf_path

    if model == "default":
        return default_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


def run_programs(
    workload: str, systems: list[str], args: argparse.Namespace, slo: SLO
) -> list[RunResult]:
    """DSL programs over the socket with `run_batch`: programs/s and cache hit rate per system."""
    from radixrt.bench.programs import program_workloads
    from radixrt.client.launcher import Runtime

    program, batch = program_workloads(args.num_requests or 64, args.seed)[workload]
    results = []
    for system in systems:
        with _radixrt_target(args, system, Runtime) as runtime:
            start = time.monotonic()
            for state in program.run_batch(
                batch, backend=runtime, temperature=0, progress_bar=True
            ):
                state.text()  # raises if the program failed
            duration = time.monotonic() - start
            stats = runtime.stats()
        summary = summarize([], duration, slo)
        summary.requests, summary.request_throughput = len(batch), len(batch) / duration
        summary.output_tokens = stats["generated_tokens"]
        summary.output_throughput = stats["generated_tokens"] / duration
        results.append(
            RunResult(
                system,
                f"run_batch of {len(batch)} programs",
                None,
                None,
                summary,
                stats["cache_hit_rate"],
                stats["num_preemptions"],
                stats["evicted_tokens"],
            )
        )
    return results


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_table(workload: str, results: list[RunResult], baseline: str | None) -> None:
    base = next((r for r in results if r.system == baseline), None)
    programs = any(r.load.startswith("run_batch") for r in results)
    # a select-only program generates nothing
    metric = "request_throughput" if programs else "output_throughput"
    head = (
        f"{'system':<28}{'load':<26}{'req/s':>7}{'tok/s':>8}{'goodput':>8}{'TTFT p50':>9}{'p99':>7}"
        f"{'TPOT p50':>9}{'ITL p99':>8}{'hit':>6}{'preempt':>8}{'fwd/req':>8}{'ratio':>7}"
    )
    print(
        f"\n{workload}" + (f" (ratio: {metric.replace('_', ' ')} over {baseline})" if base else "")
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.summary
        ratio = f"{getattr(s, metric) / getattr(base.summary, metric):.2f}x" if base else "-"
        print(
            f"{r.system:<28}{r.load[:25]:<26}{s.request_throughput:>7.2f}{s.output_throughput:>8.1f}"
            f"{s.goodput:>8.2f}{_fmt(s.ttft.p50):>8}s{_fmt(s.ttft.p99):>6}s{_fmt(s.tpot.p50 * 1e3, '.0f'):>7}ms"
            f"{_fmt(s.itl.p99 * 1e3, '.0f'):>6}ms{_fmt(r.cache_hit_rate):>6}{_fmt(r.num_preemptions, 'd'):>8}"
            f"{_fmt(s.forward_passes_per_request, '.1f'):>8}{ratio:>7}"
        )
        for tag, t in r.by_tag.items():
            print(
                f"  {tag:<48}{t.request_throughput:>7.2f}{t.output_throughput:>8.1f}{t.goodput:>8.2f}"
                f"{_fmt(t.ttft.p50):>8}s{_fmt(t.ttft.p99):>6}s{_fmt(t.tpot.p50 * 1e3, '.0f'):>7}ms"
                f"{_fmt(t.itl.p99 * 1e3, '.0f'):>6}ms"
            )
        if not programs:
            print(f"  one stream: {_fmt(s.stream_tok_s, '.1f')} tok/s after its first token")
        if r.spec_accept_length is not None:
            print(f"  speculation: {r.spec_accept_length:.2f} tokens per verifying forward")
        if r.rank_peak_rss_mb is not None:
            share = (
                ""
                if r.tp_collective_share is None
                else (f"collectives {100 * r.tp_collective_share:.1f}% of rank 0's step time; ")
            )
            peaks = ", ".join(f"{m:.0f}" for m in r.rank_peak_rss_mb)
            print(f"  processes: {share}peak resident memory {peaks} MB")
        if r.host_hit_tokens is not None:
            print(
                f"  host tier: {r.host_hit_tokens} prompt tokens loaded back, "
                f"{r.swapped_in_tokens} swapped in"
            )
        if r.mask_time_share is not None:
            print(f"  constraint masks: {100 * r.mask_time_share:.2f}% of step time")
        if r.floors is not None:
            f = r.floors
            print(
                f"  floors: compute {f.compute_s:.2f}s ({100 * f.compute_share:.0f}% reached), "
                f"weight reads {f.bandwidth_s:.2f}s ({100 * f.bandwidth_share:.0f}% reached)"
            )
    _print_against_llama(results, metric)


def _print_against_llama(results: list[RunResult], metric: str) -> None:
    """Each radixrt run over the faster of the llama.cpp peers under the same load."""
    for r in results:
        same_load = [
            p
            for p in results
            if p.system in LLAMA_PEERS
            and (p.request_rate, p.concurrency) == (r.request_rate, r.concurrency)
        ]
        if not r.system.startswith("radixrt") or not same_load:
            continue
        best = max(same_load, key=lambda p: getattr(p.summary, metric))
        ratio = getattr(r.summary, metric) / max(getattr(best.summary, metric), 1e-9)
        print(
            f"{r.system} ({r.load}) over the faster llama.cpp peer ({best.system}): "
            f"{ratio:.2f}x {metric.replace('_', ' ')}"
        )


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    workloads = [*REQUEST_WORKLOADS, *PROGRAM_WORKLOADS, "agent-tools", "all"]
    parser.add_argument(
        "--workload",
        default="shared-prefix",
        choices=workloads,
        help="request workloads: shared-prefix, multi-prefix, multi-turn, long-prompt, random, json, agent-loop, "
        "few-shot; DSL programs: "
        "agent, few-shot-select, tree-of-thought; agent-tools (with --backend http): tool-calling "
        "agents per tool_choice against an unconstrained run; all: every request and program "
        "workload in turn, plus a hit-rate plot",
    )
    parser.add_argument(
        "--systems",
        help="comma list of "
        + ", ".join([*VARIANTS, *PEERS])
        + " (default: the workload's own comparison)",
    )
    parser.add_argument(
        "--backend",
        default="engine",
        choices=["engine", "server", "http"],
        help="engine: rt.Engine (ipc socket); server: rt.Runtime over TCP; http: multi-turn chat "
        "through the OpenAI API against the same conversations over ZeroMQ",
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="radixrt's tensor-parallel ranks (a variant may override)",
    )
    parser.add_argument(
        "--chunked-prefill-size", type=int, help="radixrt's prefill chunk (default: the server's)"
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        help="open loop: Poisson arrivals per second (default: all at once)",
    )
    load.add_argument(
        "--concurrency",
        type=int,
        help="closed loop: this many clients, each sending its next session when one ends",
    )
    load.add_argument(
        "--sweep-rate",
        help="comma list of request rates: run each system at each, plot throughput and "
        "TTFT against rate, and report where median TTFT crosses the SLO",
    )
    load.add_argument(
        "--max-duration", type=float, help="seconds after which no new session starts"
    )
    load.add_argument(
        "--slo-ttft", type=float, default=1.0, help="goodput SLO: time to first token (s)"
    )
    load.add_argument(
        "--slo-tpot", type=float, default=0.05, help="goodput SLO: time per output token (s)"
    )
    shape = parser.add_argument_group("workload shape")
    shape.add_argument(
        "--num-requests",
        type=int,
        help="requests (conversations, programs) per run (default: 64; "
        "10 conversations with --backend http)",
    )
    shape.add_argument("--max-new-tokens", type=int, default=64, help="mean output length")
    shape.add_argument(
        "--fixed-output-len", action="store_true", help="every output exactly --max-new-tokens long"
    )
    shape.add_argument(
        "--prefix-tokens", type=int, default=500, help="shared-prefix: shared system prompt length"
    )
    shape.add_argument("--question-tokens", type=int, default=30)
    shape.add_argument(
        "--turns",
        type=int,
        default=6,
        help="multi-turn: turns per conversation; agent-tools: tool-call turns per agent",
    )
    shape.add_argument(
        "--num-prefixes", type=int, default=8, help="multi-prefix: distinct system prompts"
    )
    shape.add_argument(
        "--long-prompts", type=int, default=4, help="long-prompt: long prompts among the short ones"
    )
    shape.add_argument("--long-tokens", type=int, default=4000)
    shape.add_argument("--seed", type=int, default=0)
    shape.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of every request (0: greedy; sampled text has less to copy for speculation)",
    )
    parser.add_argument(
        "--output-dir", default="bench_results", help="JSON results and PNG plots go here"
    )


def run_bench(args: argparse.Namespace) -> dict[str, list[RunResult]]:
    from transformers import AutoTokenizer

    from radixrt.executor.model_loader import resolve_model_path

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    setup = setup_info(args, model_dir)
    if args.workload == "agent-tools":
        return _run_tool_bench(args, setup, out_dir)
    if args.backend == "http":
        from radixrt.bench.http_bench import run_http_bench

        result = run_http_bench(
            argparse.Namespace(
                model=args.model,
                dtype=args.dtype,
                seed=args.seed,
                max_total_tokens=args.max_total_tokens,
                num_turns=args.turns,
                num_conversations=args.num_requests,
            )
        )
        _write(
            out_dir / "http.json", {"setup": setup, "workload": "multi-turn over HTTP", **result}
        )
        return {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    machine = MachineRates.measure()  # just before the runs, on the cores they will use
    setup["machine_rates"] = asdict(machine)
    print(
        f"machine: float32 GEMM {machine.gemm_flops / 1e9:.0f} GFLOP/s, "
        f"read {machine.read_bandwidth / 1e9:.1f} GB/s"
    )

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    slo = SLO(args.slo_ttft, args.slo_tpot)
    cfg = WorkloadConfig(
        args.num_requests or 64,
        args.max_new_tokens,
        args.fixed_output_len,
        args.prefix_tokens,
        args.question_tokens,
        args.turns,
        args.long_prompts,
        args.long_tokens,
        args.seed,
        args.temperature,
        args.num_prefixes,
    )
    rates = [float(r) for r in args.sweep_rate.split(",")] if args.sweep_rate else None
    loads = (
        [Load(r, None, args.max_duration, args.seed) for r in rates]
        if rates
        else [Load(args.request_rate, args.concurrency, args.max_duration, args.seed)]
    )
    names = [*REQUEST_WORKLOADS, *PROGRAM_WORKLOADS] if args.workload == "all" else [args.workload]
    everything = {}
    for workload in names:
        systems = (args.systems or DEFAULT_SYSTEMS[workload]).split(",")
        unknown = set(systems) - set(VARIANTS) - set(PEERS)
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}")
        if workload in PROGRAM_WORKLOADS:
            results = run_programs(workload, [s for s in systems if s in VARIANTS], args, slo)
        else:
            sessions = REQUEST_WORKLOADS[workload](tokenizer, cfg)
            results = [
                r
                for system in systems
                for r in run_system(
                    system, sessions, loads, args, render, tokenizer, model_dir, slo, machine
                )
            ]
        baseline = (
            "transformers"
            if any(r.system == "transformers" for r in results)
            else systems[1]
            if len(systems) > 1
            else None
        )
        print_table(workload, results, baseline)
        name = f"{workload}-sweep" if rates else workload
        _write(
            out_dir / f"{name}.json",
            {
                "setup": setup,
                "workload": workload,
                "config": asdict(cfg),
                "slo": asdict(slo),
                "results": [asdict(r) for r in results],
            },
        )
        _plot(workload, results, rates, slo, out_dir)
        everything[workload] = results
    if len(names) > 1:
        from radixrt.bench.plots import plot_bars

        hits = {
            w: r[0].cache_hit_rate
            for w, r in everything.items()
            if r and r[0].cache_hit_rate is not None
        }
        print(
            f"plot: {plot_bars(hits, out_dir / 'cache-hit-rate.png', 'cache hit rate', 'radixrt: cache hit rate per workload')}"
        )
    return everything


def _plot(
    workload: str, results: list[RunResult], rates: list[float] | None, slo: SLO, out_dir: Path
) -> None:
    from radixrt.bench.plots import plot_cdf, plot_sweep

    if rates:
        points: dict[str, list] = {}
        for r in results:
            if r.request_rate is not None:
                points.setdefault(r.system, []).append(
                    (
                        r.request_rate,
                        r.summary.output_throughput,
                        r.summary.ttft.p50,
                        r.summary.ttft.p99,
                    )
                )
        for system, rows in points.items():
            knee = next((rate for rate, _, p50, _ in rows if p50 > slo.ttft_s), None)
            print(
                f"{system}: median TTFT "
                + (
                    f"crosses the {slo.ttft_s:g}s SLO at {knee:g} req/s"
                    if knee
                    else f"stays under {slo.ttft_s:g}s up to {rows[-1][0]:g} req/s"
                )
            )
        path = plot_sweep(
            points, slo.ttft_s, out_dir / f"{workload}-sweep.png", f"{workload}: request-rate sweep"
        )
        print(f"plot: {path}")
    if workload == "long-prompt":
        itls = {r.system: r.short_itls for r in results if r.short_itls}
        if itls:
            print(
                f"plot: {plot_cdf(itls, out_dir / 'long-prompt-itl.png', 'inter-token latency (s)', 'short requests: ITL CDF')}"
            )


def _run_tool_bench(args: argparse.Namespace, setup: dict, out_dir: Path) -> dict:
    if args.backend != "http":
        raise SystemExit("--workload agent-tools runs over HTTP: add --backend http")
    from radixrt.bench.tool_bench import ToolBenchConfig, run_tool_bench

    config = ToolBenchConfig(
        model=args.model,
        num_agents=args.num_requests or ToolBenchConfig.num_agents,
        turns=args.turns,
        max_new_tokens=args.max_new_tokens,
        max_total_tokens=args.max_total_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    result = run_tool_bench(config)
    _write(out_dir / "agent-tools.json", {"setup": setup, "workload": "agent-tools", **result})
    return {}


def _write(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"results written to {path}")
