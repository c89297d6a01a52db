"""`--workload hybrid-prefix`: prefix reuse through a hybrid model's recurrent state, against a
Llama of the same shape and against the hybrid with the cache off.

Random checkpoints of `families.SHAPE` (hidden 512, 8 layers) made with transformers' config
classes: Llama, Qwen3.5 (six Gated DeltaNet layers, two gated attention layers) and Bamba (six
Mamba-2 layers, two attention layers), with
`--model`'s tokenizer. Two workloads on an in-process Scheduler (float32, torch attention):
- agent loop: CONVERSATIONS conversations of TURNS turns; each turn resends its conversation
  (the previous turns' prompts and answers) with TURN_TOKENS new tokens and generates
  ANSWER_TOKENS; the conversations' turns run together;
- shared prompt: SHARED_REQUESTS requests of a SYSTEM_TOKENS-token prompt they all share and
  QUESTION_TOKENS of their own, sent at once, ANSWER_TOKENS each.
For each: the prefix hit rate (cached prompt tokens / prompt tokens), the prompt tokens computed,
and the wall time. Prints a Markdown table; `hybrid-prefix.json` and a bar plot.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.suites.families import BAMBA, QWEN3_5, SHAPE, checkpoint

if TYPE_CHECKING:  # the engine (torch) loads only when the suite runs
    from radixrt.engine.scheduler import Scheduler

CONVERSATIONS, TURNS, TURN_TOKENS = 4, 10, 50
SHARED_REQUESTS, SYSTEM_TOKENS, QUESTION_TOKENS = 16, 300, 30
ANSWER_TOKENS = 16
# model, its checkpoint (model_type, shape over SHAPE), cache on
SYSTEMS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("llama", {}, True),
    "qwen3.5": ("qwen3_5_text", QWEN3_5, True),
    "qwen3.5, cache off": ("qwen3_5_text", QWEN3_5, False),
    "bamba": ("bamba", BAMBA, True),
    "bamba, cache off": ("bamba", BAMBA, False),
}
# Qwen3.5-0.8B's layers (24: 18 Gated DeltaNet, 6 gated attention; 16 key and value heads of
# 128 in the linear attention) at the default model's vocabulary: about 0.5B parameters, and a
# Llama of its attention and MLP
SHAPE_0_8B: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
)
QWEN3_5_0_8B = dict(
    SHAPE_0_8B,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
SHAPES: dict[str, dict[str, tuple[str, dict[str, Any], bool]]] = {
    "small": SYSTEMS,
    "qwen3.5-0.8b": {
        "llama": ("llama", SHAPE_0_8B, True),
        "qwen3.5": ("qwen3_5_text", QWEN3_5_0_8B, True),
        "qwen3.5, cache off": ("qwen3_5_text", QWEN3_5_0_8B, False),
    },
}
POOL = 16384  # tokens of KV every system holds
# a hybrid's state slots per shape: about the bytes a Llama of the shape spends on the KV of the
# attention layers the hybrid replaces, over POOL tokens (small: 6 of 8 layers' 16 KB a token,
# 201 MB, in 0.8 MB slots; 0.8B: 18 of 24 layers' 98 KB a token, 1.2 GB, in 19 MB slots): the
# same memory as the Llama's (the default, no more than the hybrid's own KV bytes, would give it
# a quarter of that)
STATE_SLOTS = {"small": 256, "qwen3.5-0.8b": 64}


@dataclass(frozen=True)
class Figures:
    system: str
    workload: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@register("hybrid-prefix")
def run_hybrid_prefix(run: BenchRun) -> dict[str, list[RunResult]]:
    from radixrt.executor.model_loader import resolve_model_path

    tokenizer = resolve_model_path(run.config.model)
    rows: list[Figures] = []
    systems = SHAPES[run.config.hybrid_shape]
    for system, (model_type, extra, cache) in systems.items():
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint(Path(tmp), model_type, extra, tokenizer)
            for workload, drive in (("agent loop", _agent_loop), ("shared prompt", _shared)):
                scheduler = _scheduler(Path(tmp), cache, STATE_SLOTS[run.config.hybrid_shape])
                start = time.perf_counter()
                drive(scheduler)
                stats = scheduler.stats()
                rows.append(
                    Figures(
                        system,
                        workload,
                        stats["prompt_tokens_total"],
                        stats["cached_prompt_tokens_total"],
                        time.perf_counter() - start,
                    )
                )
                print(_line(rows[-1]), flush=True)
    print(table(rows))
    run.write(
        "hybrid-prefix",
        {
            "workload": "hybrid-prefix",
            "shape": run.config.hybrid_shape,
            "checkpoints": {
                system: {**SHAPE, **extra} for system, (_, extra, _) in systems.items()
            },
            "results": [{**asdict(r), "hit_rate": r.hit_rate} for r in rows],
        },
    )
    plot(rows, run.out_dir / "hybrid-prefix.png")
    return {}


def _scheduler(folder: Path, cache: bool, state_slots: int) -> Scheduler:
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    args = ServerArgs(
        model=str(folder),
        attention_backend="torch",
        max_total_tokens=POOL,
        max_mamba_cache_size=state_slots,  # a Llama ignores it
        disable_radix_cache=not cache,
        log_level="warning",
    )
    return Scheduler.from_server_args(args)


def _generate(scheduler: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's ANSWER_TOKENS greedy tokens, the prompts run together."""
    from radixrt.sampling_params import SamplingParams

    params = {"max_new_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}
    reqs = []
    for ids in prompts:
        reqs.append(scheduler.make_request(f"r{id(ids)}", ids, SamplingParams.from_dict(params)))
        scheduler.add_request(reqs[-1])
    while scheduler.has_work():
        scheduler.step()
    return [r.output_ids for r in reqs]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _agent_loop(scheduler: Scheduler) -> None:
    rng = random.Random(0)
    conversations: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    for _ in range(TURNS):
        conversations = [c + _tokens(rng, TURN_TOKENS) for c in conversations]
        answers = _generate(scheduler, conversations)
        conversations = [c + a for c, a in zip(conversations, answers)]


def _shared(scheduler: Scheduler) -> None:
    rng = random.Random(1)
    system = _tokens(rng, SYSTEM_TOKENS)
    _generate(scheduler, [system + _tokens(rng, QUESTION_TOKENS) for _ in range(SHARED_REQUESTS)])


def _line(r: Figures) -> str:
    return (
        f"{r.system:>20} {r.workload:>14}: hit rate {r.hit_rate:.1%}, {r.computed} of "
        f"{r.prompt_tokens} prompt tokens computed, {r.seconds:.1f} s"
    )


def table(rows: list[Figures]) -> str:
    lines = [
        "| model | workload | hit rate | prompt tokens computed | of | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.system} | {r.workload} | {r.hit_rate:.1%} | {r.computed:,} | "
            f"{r.prompt_tokens:,} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Figures], path: Path) -> None:
    """Two panels, one per workload: hit rate and seconds of each system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 6), squeeze=False)
    for j, workload in enumerate(workloads):
        mine = [r for r in rows if r.workload == workload]
        names = [r.system for r in mine]
        axes[0][j].bar(names, [100 * r.hit_rate for r in mine], color="tab:green")
        axes[0][j].set_title(workload)
        axes[0][j].set_ylabel("prefix hit rate (%)")
        axes[1][j].bar(names, [r.seconds for r in mine], color="tab:blue")
        axes[1][j].set_ylabel("seconds")
    fig.suptitle("Prefix reuse through Qwen3.5's recurrent state (random weights, CPU, float32)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
