"""`--workload family-step-times`: the decode step of each model family on the CPU, next to
Llama of the same shape.

Random checkpoints of one shape (hidden 512, 8 layers, 8 query and 4 KV heads of 64, MLP 1536,
vocabulary 49152, tied embeddings) made with transformers' config classes, with `--model`'s
tokenizer. The MoE families have 8 experts, top 2, each expert's MLP 768 wide: the two active
experts hold as many weights as the dense MLP, so a token computes what a dense token does and
only the weights read differ. LFM2, Qwen3.5 and Bamba hold a state per request in their
convolution, Gated DeltaNet and Mamba-2 layers (`LFM2`, `QWEN3_5`, `BAMBA`). The windowed
families (Mistral, Gemma 2 and 3's local layers) have a window of 32, shorter than the prompts.
An in-process Scheduler (float32, torch attention) decodes each of `--batches` (1,32) of
distinct prompts of the first of `--contexts` (64) tokens (`radixrt.bench.decode_step`); a
batch's figure is the least of `--repeats` (3) medians of `--steps` (16) steps (the least: other
processes on a shared machine only ever add time). Torch runs one thread: on a loaded 2-core
machine two threads wait on each other at every barrier (a Llama step took 0.5 s, not 25 ms).
Prints a Markdown table; `family-step-times.json` and a bar plot, `family-step-times.png`.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixrt.bench.decode_step import (
    StepTime,
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

SHAPE: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    pad_token_id=0,
)
WINDOW = 32
EXPERTS, TOP_K, EXPERT_MLP = 8, 2, 768  # TOP_K * EXPERT_MLP == the dense MLP's 1536
GEMMA = dict(query_pre_attn_scalar=64, sliding_window=WINDOW)
# Qwen3.5's linear attention at SHAPE's width: 4 key heads of 64 shared by 8 value heads of 64
# (its mixer's projections hold about what an attention layer's do); six of its eight layers
QWEN3_5 = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
# LFM2: short convolutions on five of the eight layers, the MLP SHAPE's (not adjusted)
LFM2 = dict(
    layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv"]
    + ["full_attention"],
    block_auto_adjust_ff_dim=False,
)
# Bamba: Mamba-2 layers (16 heads of 64 over a 64-wide state, one group) on six of the eight
# layers, attention on the fourth and the last
BAMBA = dict(
    attn_layer_indices=[3, 7],
    mamba_n_heads=16,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=64,
    mamba_expand=2,
    mamba_chunk_size=256,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", GEMMA),
    "gemma3": ("gemma3_text", GEMMA),
    "phi3": ("phi3", {}),
    "mistral (window 32)": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": (
        "mixtral",
        {
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "intermediate_size": EXPERT_MLP,
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": EXPERT_MLP,
            "norm_topk_prob": True,
        },
    ),
    "lfm2": ("lfm2", LFM2),
    "qwen3.5": ("qwen3_5_text", QWEN3_5),
    "bamba": ("bamba", BAMBA),
}
PROMPT = 64
THREADS = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Params:
    """A checkpoint's parameter count, and the part a token computes with (MoE: top-k experts)."""

    total: int
    active: int

    def __str__(self) -> str:
        text = f"{self.total / 1e6:.1f} M"
        return text if self.active == self.total else f"{text} ({self.active / 1e6:.1f} M active)"


@dataclass(frozen=True)
class FamilySteps:
    """One family's checkpoint and its step at each batch (in `--batches`' order)."""

    family: str
    params: Params
    steps: list[StepTime]


@register("family-step-times")
def run_family_steps(run: BenchRun) -> dict[str, list[RunResult]]:
    import torch
    from tqdm import tqdm

    from radixrt.executor.model_loader import resolve_model_path

    config = run.config
    batches = config.batch_sizes or [1, 32]
    context = (config.context_lens or [PROMPT])[0]
    tokenizer = resolve_model_path(config.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    rows = []
    try:
        with tqdm(total=len(FAMILIES) * len(batches), desc="families x batches") as bar:
            for name, (model_type, extra) in FAMILIES.items():
                bar.set_postfix_str(name)
                with tempfile.TemporaryDirectory() as tmp:
                    params = checkpoint(Path(tmp), model_type, extra, tokenizer)
                    steps = []
                    for batch in batches:
                        steps.append(_measure(run, Path(tmp), batch, context))
                        bar.update()
                    rows.append(FamilySteps(name, params, steps))
    finally:
        torch.set_num_threads(threads)
    print(f"contexts of {context} tokens")
    print(table(rows, batches))
    run.write(
        "family-step-times",
        {
            "workload": "family-step-times",
            "shape": SHAPE,
            "context": context,
            "batches": batches,
            "threads": THREADS,
            "results": [{**asdict(r), "params": str(r.params)} for r in rows],
        },
    )
    plot(rows, batches, run.out_dir / "family-step-times.png")
    return {}


def checkpoint(folder: Path, model_type: str, extra: dict[str, Any], tokenizer: Path) -> Params:
    """Save a random `model_type` checkpoint of SHAPE (with `extra`) and the tokenizer of the
    model folder `tokenizer` in `folder`; return its parameter counts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SHAPE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return Params(total, total - experts + experts * TOP_K // EXPERTS)


def _measure(run: BenchRun, folder: Path, batch: int, context: int) -> StepTime:
    """The least of `--repeats` medians of `--steps` steps at `batch` over private `context`
    token prompts, on a scheduler of the checkpoint in `folder` warmed by a step at batch 4
    (the C glue built, oneDNN's kernels chosen)."""
    from radixrt.config import ServerArgs
    from radixrt.engine.scheduler import Scheduler

    config = run.config
    steps, repeats = config.steps or 16, config.repeats or 3
    rows = max(batch, 4)
    pool = max(8192, rows * (context + 2 * steps + 16))
    args = ServerArgs(
        model=str(folder),
        attention_backend="torch",
        max_total_tokens=pool,
        # a recurrent model's state slots: one per row decoding (by default no more than the
        # pool's bytes hold, fewer than 32 rows at this shape's 8192 tokens), and a snapshot each
        max_mamba_cache_size=2 * rows,
        log_level="warning",
    )
    scheduler = Scheduler.from_server_args(args)
    try:
        _decode(scheduler, 4, 4, config.seed, context)
        return min(
            _decode(scheduler, batch, steps, config.seed + r, context) for r in range(repeats)
        )
    finally:
        scheduler.close()


def _decode(scheduler: Scheduler, batch: int, steps: int, seed: int, context: int) -> StepTime:
    reqs = start_decoding(scheduler, private_prompts(batch, context, seed), steps)
    step = time_steps(scheduler, reqs, steps)
    release(scheduler, reqs)
    return step


def table(rows: list[FamilySteps], batches: list[int]) -> str:
    """Markdown: each family's params, ms per step at each batch, and its ratios to llama's."""
    base = next(r for r in rows if r.family == "llama").steps
    per_batch = " | ".join(f"batch {b} ms/step" for b in batches)
    slashed = " / ".join(map(str, batches))
    lines = [
        f"| family | params | {per_batch} | ratio to llama ({slashed}) |",
        "|---|---|" + "---|" * len(batches) + "---|",
    ]
    for r in rows:
        ms = " | ".join(f"{s.wall_ms:.1f}" for s in r.steps)
        ratio = " / ".join(f"{s.wall_s / b.wall_s:.2f}x" for s, b in zip(r.steps, base))
        lines.append(f"| {r.family} | {r.params} | {ms} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[FamilySteps], batches: list[int], path: Path) -> None:
    """Bars, one panel per batch: ms per decode step of each family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    names = [r.family for r in rows]
    for i, (axis, batch) in enumerate(zip(axes[0], batches)):
        axis.bar(names, [r.steps[i].wall_ms for r in rows], color="tab:blue")
        axis.set_title(f"batch {batch}")
        axis.set_ylabel("ms per decode step")
        axis.tick_params(axis="x", labelrotation=45)
        for label in axis.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle("Decode step time on the CPU (float32, 8 layers x 512, random weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
