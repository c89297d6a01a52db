"""`radixrt bench`: serving benchmarks against peers and baselines, in one run."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

WORDS = ("river stone light cloud paper engine garden window silver market winter signal forest "
         "harbor violet copper lantern meadow thunder canyon orbit velvet glacier ember quartz").split()


@dataclass
class BenchResult:
    system: str
    requests: int
    duration_s: float
    output_tokens: int
    output_throughput: float  # tokens/s
    requests_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    cache_hit_rate: float | None = None
    num_preemptions: int | None = None


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _text(rng: random.Random, tokenizer, num_tokens: int) -> str:
    words = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < num_tokens:
        words.extend(rng.choice(WORDS) for _ in range(8))
    return " ".join(words)


def shared_prefix_workload(tokenizer, num_requests: int, prefix_tokens: int, question_tokens: int,
                           seed: int = 0) -> list[list[int]]:
    """One long system prompt shared by every request, each with its own short question."""
    rng = random.Random(seed)
    system = "System: you are a helpful assistant. " + _text(rng, tokenizer, prefix_tokens)
    return [tokenizer.encode(f"{system}\nQuestion {i}: {_text(rng, tokenizer, question_tokens)}?\nAnswer:",
                             add_special_tokens=False) for i in range(num_requests)]


def _result(name: str, duration: float, ttfts: list[float], tokens: int, stats: dict | None) -> BenchResult:
    return BenchResult(name, len(ttfts), duration, tokens, tokens / duration, len(ttfts) / duration,
                       statistics.mean(ttfts), percentile(ttfts, 50), percentile(ttfts, 99),
                       stats["cache_hit_rate"] if stats else None, stats["num_preemptions"] if stats else None)


def run_radixrt(name: str, prompts: list[list[int]], max_new_tokens: int, backend: str = "engine",
                **server_args) -> BenchResult:
    """Concurrent clients (one thread per request) against `rt.Engine` or a TCP `rt.Runtime`."""
    from radixrt.runtime import Engine, Runtime

    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    with (Runtime if backend == "server" else Engine)(log_level="warning", **server_args) as engine:
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        start = time.monotonic()
        results = []
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = [pool.submit(engine.generate, input_ids=p, sampling_params=params) for p in prompts]
            for f in tqdm(as_completed(futures), total=len(futures), desc=name, leave=False):
                results.append(f.result())
        duration = time.monotonic() - start
        stats = engine.stats()
    return _result(name, duration, [r["meta_info"]["ttft"] for r in results],
                   sum(len(r["output_ids"]) for r in results), stats)


def run_in_process(name: str, prompts: list[list[int]], max_new_tokens: int, **server_args) -> BenchResult:
    """The scheduler stepped on this thread with no socket at all: the floor for the overhead."""
    from radixrt.config import ServerArgs
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler import Scheduler

    scheduler = Scheduler(ServerArgs(log_level="warning", **server_args))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    scheduler.add_request(scheduler.make_request("warm-up", [1, 2, 3], SamplingParams(max_new_tokens=2)))
    while scheduler.has_work():
        scheduler.step()
    scheduler.flush_cache()
    start = time.monotonic()
    reqs = [scheduler.make_request(str(i), p, params) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.add_request(req)
    with tqdm(total=len(reqs), desc=name, leave=False) as bar:
        while scheduler.has_work():
            bar.update(sum(r.finished for r in scheduler.step()))
    duration = time.monotonic() - start
    return _result(name, duration, [r.first_token_time - r.arrival for r in reqs],
                   sum(len(r.output_ids) for r in reqs), scheduler.stats())


def run_transformers(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype: str) -> BenchResult:
    """What a user without a serving engine does: one padded batch through `generate`."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if dtype == "bfloat16"
                                                 else torch.float32).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    first_token_at: list[float] = []

    class FirstToken(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            first_token_at.append(time.monotonic())
            return torch.zeros(ids.shape[0], dtype=torch.bool)

    start = time.monotonic()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([FirstToken()]))
    duration = time.monotonic() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return _result("transformers", duration, [first_token_at[0] - start] * len(prompts), tokens, None)


def _program_workloads():
    """Frontend programs shaped like the real thing: (name, program, list of kwargs)."""
    import radixrt as rt

    rng = random.Random(0)
    shots = "".join(f"Question: {' '.join(rng.choice(WORDS) for _ in range(12))}?\n(A) {rng.choice(WORDS)} "
                    f"(B) {rng.choice(WORDS)} (C) {rng.choice(WORDS)} (D) {rng.choice(WORDS)}\nAnswer: "
                    f"{rng.choice('ABCD')}\n\n" for _ in range(5))

    @rt.function
    def few_shot(s, question):
        s += shots + f"Question: {question}?\n(A) one (B) two (C) three (D) four\nAnswer: "
        s += rt.select("answer", choices=["A", "B", "C", "D"])

    tools = "You are an agent. Think, then act with one tool per turn.\n" + "".join(
        f"Tool {name}: {' '.join(rng.choice(WORDS) for _ in range(40))}. Input: {rng.choice(WORDS)}.\n"
        for name in ("search", "calculate", "lookup", "translate", "finish"))

    @rt.function
    def agent(s, task, turns=4):
        s += rt.system(tools)
        s += rt.user(task)
        for t in range(turns):
            s += rt.assistant("Thought: " + rt.gen(f"thought{t}", max_tokens=12, stop="\n"))
            s += rt.user(f"Observation {t}: the tool returned {rng.randrange(100)}.")

    @rt.function
    def tree_of_thought(s, question):
        s += rt.user(question)
        s += rt.assistant_begin()
        ideas = s.fork(3)
        ideas += lambda i: f"Idea {i}: " + rt.gen("idea", max_tokens=8)
        for idea in ideas:
            branches = idea.fork(3)
            branches += lambda j: f" Step {j}: " + rt.gen("step", max_tokens=8)
            branches.join()
        ideas.join()

    questions = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(64)]
    return {
        "few-shot": (few_shot, [{"question": q} for q in questions]),
        "agent": (agent, [{"task": f"Task {i}: {q}"} for i, q in enumerate(questions[:16])]),
        "tree-of-thought": (tree_of_thought, [{"question": q} for q in questions[:6]]),
    }


def run_programs(workload: str, args: argparse.Namespace) -> list[BenchResult]:
    """The same programs over the socket, with the radix cache and without, in one run."""
    from radixrt.runtime import Runtime

    program, batch = _program_workloads()[workload]
    results = []
    for name, extra in (("radixrt", {}), ("radixrt-no-cache", {"disable_radix_cache": True})):
        with Runtime(model=args.model, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                     log_level="warning", **extra) as runtime:
            start = time.monotonic()
            states = program.run_batch(batch, backend=runtime, temperature=0, progress_bar=True)
            for state in states:
                state.text()  # raises if the program failed
            duration = time.monotonic() - start
            stats = runtime.stats()
        results.append(BenchResult(name, len(batch), duration, stats["generated_tokens"],
                                   stats["generated_tokens"] / duration, len(batch) / duration, float("nan"),
                                   float("nan"), float("nan"), stats["cache_hit_rate"], stats["num_preemptions"]))
    print(f"{workload}: {len(batch)} programs")
    print(f"{'system':<20}{'programs/s':>11}{'hit rate':>10}{'ratio':>8}")
    for r in results:
        print(f"{r.system:<20}{r.requests_per_s:>11.2f}{r.cache_hit_rate:>10.2f}"
              f"{r.requests_per_s / results[-1].requests_per_s:>7.2f}x")
    return results


def print_table(results: list[BenchResult], baseline: str) -> None:
    base = next((r for r in results if r.system == baseline), None)
    print(f"(ratio: output throughput over {baseline}'s)")
    head = (f"{'system':<20}{'tok/s':>8}{'req/s':>7}{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'hit rate':>9}"
            f"{'preempt':>8}{'ratio':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = f"{r.output_throughput / base.output_throughput:.2f}x" if base else "-"
        hit = f"{r.cache_hit_rate:.2f}" if r.cache_hit_rate is not None else "-"
        pre = str(r.num_preemptions) if r.num_preemptions is not None else "-"
        print(f"{r.system:<20}{r.output_throughput:>8.1f}{r.requests_per_s:>7.2f}{r.ttft_mean_s:>9.2f}s"
              f"{r.ttft_p50_s:>7.2f}s{r.ttft_p99_s:>7.2f}s{hit:>9}{pre:>8}{ratio:>8}")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="shared-prefix",
                        choices=["shared-prefix", "few-shot", "agent", "tree-of-thought"],
                        help="shared-prefix: raw requests; the others run frontend programs over the socket")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=500, help="length of the shared system prompt")
    parser.add_argument("--question-tokens", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--backend", default="engine", choices=["engine", "server"],
                        help="engine: the core comparison; server: the TCP server against the scheduler "
                             "stepped in this process (the socket's overhead)")
    parser.add_argument("--systems", default=None,
                        help="comma list of radixrt, radixrt-no-cache, transformers, radixrt-server, "
                             "radixrt-inprocess (default: by --backend)")
    parser.add_argument("--output", default="bench_results/shared-prefix.json", help="JSON file for the results")


def run_bench(args: argparse.Namespace) -> list[BenchResult]:
    from transformers import AutoTokenizer

    from radixrt.model_loader import resolve_model_path

    if args.workload != "shared-prefix":
        results = run_programs(args.workload, args)
        _save(args, results)
        return results
    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = shared_prefix_workload(tokenizer, args.num_requests, args.prefix_tokens, args.question_tokens)
    print(f"shared-prefix: {len(prompts)} requests, prompt ~{statistics.mean(map(len, prompts)):.0f} tokens "
          f"(~{args.prefix_tokens} shared), {args.max_new_tokens} new tokens each, all submitted at once")
    common = {"model": str(model_dir), "dtype": args.dtype, "max_total_tokens": args.max_total_tokens}
    new = args.max_new_tokens
    runners = {
        "radixrt": lambda: run_radixrt("radixrt", prompts, new, **common),
        "radixrt-no-cache": lambda: run_radixrt("radixrt-no-cache", prompts, new, disable_radix_cache=True, **common),
        "transformers": lambda: run_transformers(model_dir, prompts, new, args.dtype),
        "radixrt-server": lambda: run_radixrt("radixrt-server", prompts, new, backend="server", **common),
        "radixrt-inprocess": lambda: run_in_process("radixrt-inprocess", prompts, new, **common),
    }
    systems = (args.systems or {"engine": "radixrt,radixrt-no-cache,transformers",
                                "server": "radixrt-inprocess,radixrt-server"}[args.backend]).split(",")
    results = [runners[name]() for name in tqdm(systems, desc="systems")]
    print_table(results, "transformers" if "transformers" in systems else results[0].system)
    _save(args, results)
    return results


def _save(args: argparse.Namespace, results: list[BenchResult]) -> None:
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": vars(args) | {"func": None}, "results": [asdict(r) for r in results]},
                              indent=2, default=str))
    print(f"results written to {out}")
