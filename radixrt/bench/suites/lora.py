"""`--workload lora`: what serving LoRA adapters costs a decode step, and loading one.

In-process schedulers on `--model` (no sockets: the step is what is measured) decode a batch
of `--num-requests` requests (32 when unset) of `--question-tokens`-token private prompts,
timing `--max-new-tokens` (64) steps once all of them decode (`radixrt.bench.decode_step`),
under 0, 1, 4 and 8 distinct adapters (requests dealt round-robin), against the base model
served without adapter support, each case `--repeats` (2) times interleaved, its best kept. The adapters are random, rank
`ADAPTER_RANK` on all seven projections (written in peft's format here: no peft needed). The
median decode step of each case (wall time, and the process's CPU time: on a machine shared
with other work the CPU time is the steadier measure of what a step costs), and its ratios to
the base's, go to `lora.json` and a bar plot;
so does the time to load an adapter (read, sliced and validated; its first copy into a pool
slot is inside the first step that uses it).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from radixrt.bench.decode_step import (
    StepTime,
    new_tokens_for,
    private_prompts,
    release,
    start_decoding,
    time_steps,
)
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

if TYPE_CHECKING:  # the engine (torch) loads only when the suite runs
    from radixrt.engine.scheduler import Scheduler

ADAPTER_RANK = 8
ADAPTER_COUNTS = (0, 1, 4, 8)
PROJECTIONS = {"self_attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}
DEFAULT_BATCH = 32
REPEATS = 2  # unless --repeats: each case runs this often, interleaved; its best median counts


@dataclass(frozen=True)
class LoraCase:
    """One measured case: `adapters` distinct adapters over the batch (None: the base model
    served without adapter support), its median decode step in seconds (wall, and CPU time of
    the process's threads), and their ratios to the base's."""

    adapters: int | None
    step_s: float
    cpu_s: float
    ratio: float = 1.0
    cpu_ratio: float = 1.0

    @property
    def label(self) -> str:
        return "base" if self.adapters is None else f"{self.adapters} adapters"


@register("lora")
def run_lora_suite(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.executor.model_loader import resolve_model_path

    model_dir = resolve_model_path(run.config.model)
    batch = run.config.num_requests or DEFAULT_BATCH
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(model_dir, Path(tmp), max(ADAPTER_COUNTS))
        base, served = (_scheduler(run, model_dir, batch, lora) for lora in (False, True))
        load_s = []
        for name, path in paths.items():
            start = time.perf_counter()
            served.load_lora(name, str(path))
            load_s.append(time.perf_counter() - start)
        best: dict[int | None, StepTime] = {}
        repeats = run.config.repeats or REPEATS
        for count in tqdm([None, *ADAPTER_COUNTS] * repeats, desc="lora cases"):
            names = list(paths)[: count or 0]
            step = _decode_step(run, base if count is None else served, names, batch)
            best[count] = min(best.get(count, step), step)
        base.close()
        served.close()
    b = best[None]
    results = [
        LoraCase(c, s.wall_s, s.cpu_s, s.wall_s / b.wall_s, s.cpu_s / b.cpu_s)
        for c, s in best.items()
    ]
    _print(results, batch, statistics.median(load_s))
    run.write(
        "lora",
        {
            "workload": "lora",
            "batch": batch,
            "adapter_rank": ADAPTER_RANK,
            "adapter_load_s": statistics.median(load_s),
            "cases": [{**asdict(r), "label": r.label} for r in results],
        },
    )
    _plot(results, run, batch)
    return {}


def write_random_adapters(model_dir: Path, out: Path, count: int) -> dict[str, Path]:
    """`count` random rank-ADAPTER_RANK adapters over every projection of `model_dir`'s model, as
    peft saves them (adapter_config.json, adapter_model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shapes = {
        "q": (cfg.num_attention_heads * hd, cfg.hidden_size),
        "k": (cfg.num_key_value_heads * hd, cfg.hidden_size),
        "v": (cfg.num_key_value_heads * hd, cfg.hidden_size),
        "o": (cfg.hidden_size, cfg.num_attention_heads * hd),
        "gate": (cfg.intermediate_size, cfg.hidden_size),
        "up": (cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
    }
    paths = {}
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for part, projections in PROJECTIONS.items():
                for p in projections:
                    (rows, cols), key = (
                        shapes[p],
                        f"base_model.model.model.layers.{layer}.{part}.{p}_proj",
                    )
                    tensors[f"{key}.lora_A.weight"] = (
                        torch.randn(ADAPTER_RANK, cols, generator=g) * 0.02
                    )
                    tensors[f"{key}.lora_B.weight"] = (
                        torch.randn(rows, ADAPTER_RANK, generator=g) * 0.02
                    )
        folder = out / f"adapter{i}"
        folder.mkdir()
        save_file(tensors, folder / "adapter_model.safetensors")
        targets = [f"{p}_proj" for ps in PROJECTIONS.values() for p in ps]
        config = {
            "peft_type": "LORA",
            "r": ADAPTER_RANK,
            "lora_alpha": 2 * ADAPTER_RANK,
            "target_modules": targets,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config))
        paths[f"adapter{i}"] = folder
    return paths


def _scheduler(run: BenchRun, model_dir: Path, batch: int, lora: bool) -> Scheduler:
    """An in-process scheduler on the model, room for the batch; with `lora`, adapter support
    (rank ADAPTER_RANK, 8 slots)."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    config = run.config
    args = ServerArgs(
        model=str(model_dir),
        dtype=config.dtype,
        max_total_tokens=batch
        * (config.question_tokens + new_tokens_for(batch, config.new_tokens)),
        max_running_requests=batch,
        log_level="warning",
        enable_lora=lora,
        max_lora_rank=ADAPTER_RANK if lora else None,
    )
    return Scheduler.from_server_args(args)


def _decode_step(run: BenchRun, scheduler: Scheduler, names: list[str], batch: int) -> StepTime:
    """The median decode step of `batch` requests dealt round-robin over the adapters `names`
    (none: the base) over `--max-new-tokens` steps, while all of them decode."""
    from radixrt.engine.request import RequestScope

    config = run.config
    prompts = private_prompts(batch, config.question_tokens, config.seed)
    scopes = [RequestScope(lora_path=names[i % len(names)] if names else "") for i in range(batch)]
    reqs = start_decoding(scheduler, prompts, config.new_tokens, scopes)
    step = time_steps(scheduler, reqs, config.new_tokens)
    release(scheduler, reqs)
    return step


def _print(results: list[LoraCase], batch: int, load_s: float) -> None:
    print(f"\nLoRA decode step at batch {batch} (rank {ADAPTER_RANK}, all seven projections)")
    print(f"{'case':<12} {'step (ms)':>10} {'x base':>8} {'CPU (ms)':>10} {'x base':>8}")
    for r in results:
        print(
            f"{r.label:<12} {r.step_s * 1e3:>10.1f} {r.ratio:>8.2f} "
            f"{r.cpu_s * 1e3:>10.1f} {r.cpu_ratio:>8.2f}"
        )
    print(f"adapter load: {load_s * 1e3:.0f} ms (median)")


def _plot(results: list[LoraCase], run: BenchRun, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.label for r in results], [r.cpu_s * 1e3 for r in results], color="tab:blue")
    for i, r in enumerate(results):
        ax.annotate(f"{r.cpu_ratio:.2f}x", (i, r.cpu_s * 1e3), ha="center", va="bottom")
    ax.set_ylabel("decode step, CPU time (ms)")
    ax.set_title(f"LoRA adapters at batch {batch}: decode step time")
    fig.tight_layout()
    path = run.out_dir / "lora.png"
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")
