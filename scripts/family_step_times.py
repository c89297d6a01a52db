"""Decode step time of each model family on the CPU, next to Llama of the same shape.

    python scripts/family_step_times.py --output-dir /tmp/families [--steps 16] [--threads 1]

Random checkpoints of one shape (hidden 512, 8 layers, 8 query and 4 KV heads of 64, MLP 1536,
vocabulary 49152, tied embeddings) made with transformers' config classes. The MoE families have
8 experts, top 2, each expert's MLP 768 wide: the two active experts hold as many weights as the
dense MLP, so a token computes what a dense token does and only the weights read differ. The
windowed families (Mistral, Gemma 2 and 3's local layers) have a window of 32, shorter than the
prompts. An in-process Scheduler (float32, torch attention) prefills batch 1 and batch 32 of
distinct 64-token prompts, then times decode `step()`s with the whole batch running; a batch's
figure is the least of `--repeats` medians of `--steps` steps (the least: other processes on a
shared machine only ever add time). Torch runs `--threads` threads, 1 by default: on a loaded
2-core machine two threads wait on each other at every barrier (a Llama step took 0.5 s, not
25 ms). Prints a Markdown table and saves a bar plot,
`family-step-times.png`, in `--output-dir`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from radixrt.config import ServerArgs  # noqa: E402
from radixrt.engine.scheduler import Scheduler  # noqa: E402
from radixrt.executor.model_loader import resolve_model_path  # noqa: E402
from radixrt.sampling_params import SamplingParams  # noqa: E402

SHAPE = dict(
    vocab_size=49152,
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    pad_token_id=0,
)
WINDOW = 32
EXPERTS, TOP_K, EXPERT_MLP = 8, 2, 768  # TOP_K * EXPERT_MLP == the dense MLP's 1536
GEMMA = dict(query_pre_attn_scalar=64, sliding_window=WINDOW)
FAMILIES = {
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
}
BATCHES = (1, 32)
PROMPT = 64


@dataclass(frozen=True)
class Params:
    """A checkpoint's parameter count, and the part a token computes with (MoE: top-k experts)."""

    total: int
    active: int

    def __str__(self) -> str:
        text = f"{self.total / 1e6:.1f} M"
        return text if self.active == self.total else f"{text} ({self.active / 1e6:.1f} M active)"


def checkpoint(folder: Path, model_type: str, extra: dict) -> Params:
    """Save a random `model_type` checkpoint of SHAPE (with `extra`) and the default model's
    tokenizer in `folder`; return its parameter counts."""
    config = AutoConfig.for_model(model_type, **{**SHAPE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer = resolve_model_path("default")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return Params(total, total - experts + experts * TOP_K // EXPERTS)


def decode_step_ms(scheduler: Scheduler, batch: int, steps: int) -> float:
    """Median time of a decode `step()` with `batch` requests all decoding."""
    params = SamplingParams.from_dict(
        {"max_new_tokens": steps + 8, "temperature": 0, "ignore_eos": True}
    )
    for i in range(batch):
        prompt = [(1000 + 97 * i + j) % 40000 + 100 for j in range(PROMPT)]
        scheduler.add_request(scheduler.make_request(f"r{i}", prompt, params))
    while scheduler.waiting or any(r.tokens_to_compute > 1 for r in scheduler.running):
        scheduler.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - start)
    assert len(scheduler.running) == batch, "a request finished while timed"
    for i in range(batch):
        scheduler.abort(f"r{i}")
    scheduler.flush_cache()
    return 1000 * statistics.median(times)


def measure(folder: Path, steps: int, repeats: int, bar: tqdm) -> list[float]:
    """The least of `repeats` medians at each of BATCHES, for the checkpoint in `folder`."""
    scheduler = Scheduler.from_server_args(
        ServerArgs(
            model=str(folder), attention_backend="torch", max_total_tokens=8192, log_level="warning"
        )
    )
    try:
        decode_step_ms(scheduler, 4, 4)  # warm-up: the C glue built, oneDNN's kernels chosen
        ms = []
        for batch in BATCHES:
            ms.append(min(decode_step_ms(scheduler, batch, steps) for _ in range(repeats)))
            bar.update()
        return ms
    finally:
        scheduler.close()


def table(rows: dict[str, tuple[Params, list[float]]]) -> str:
    """Markdown: each family's params, ms per step at BATCHES, and its ratio to llama's."""
    base = rows["llama"][1]
    lines = [
        "| family | params | batch 1 ms/step | batch 32 ms/step | ratio to llama (1 / 32) |",
        "|---|---|---|---|---|",
    ]
    for name, (params, ms) in rows.items():
        ratio = " / ".join(f"{m / b:.2f}x" for m, b in zip(ms, base))
        lines.append(f"| {name} | {params} | {ms[0]:.1f} | {ms[1]:.1f} | {ratio} |")
    return "\n".join(lines)


def plot(rows: dict[str, tuple[Params, list[float]]], path: Path) -> None:
    """Grouped bars: ms per decode step of each family at each of BATCHES."""
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(11, 4))
    names = list(rows)
    for axis, (i, batch) in zip(axes, enumerate(BATCHES)):
        axis.bar(names, [rows[n][1][i] for n in names], color="tab:blue")
        axis.set_title(f"batch {batch}")
        axis.set_ylabel("ms per decode step")
        axis.tick_params(axis="x", labelrotation=45)
        for label in axis.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle("Decode step time on the CPU (float32, 8 layers x 512, random weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tqdm(total=len(FAMILIES) * len(BATCHES), desc="families x batches") as bar:
        for name, (model_type, extra) in FAMILIES.items():
            bar.set_postfix_str(name)
            with tempfile.TemporaryDirectory() as tmp:
                params = checkpoint(Path(tmp), model_type, extra)
                rows[name] = (params, measure(Path(tmp), args.steps, args.repeats, bar))
    print(table(rows))
    plot(rows, args.output_dir / "family-step-times.png")


if __name__ == "__main__":
    main()
