"""Decode step time of each model family on the CPU, next to Llama of the same shape.

    python scripts/bench_families.py [--layers 12] [--steps 24]

Random checkpoints of one shape (SmolLM2-135M's widths: hidden 576, 9 query and 3 KV heads of
64, MLP 1536, vocabulary 49152; MoE families 8 experts, top 2) made with transformers' config
classes; an in-process Scheduler (float32, torch attention) runs batch 1 and batch 32 (distinct
64-token prompts) after a warm-up run; a batch's figure is the least of `--repeats` medians of
its decode `step()`s (the least: other processes on a shared machine only ever add time),
printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.executor.model_loader import resolve_model_path
from radixrt.sampling_params import SamplingParams

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    pad_token_id=0,
)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma3": ("gemma3_text", {"query_pre_attn_scalar": 64, "sliding_window": 2048}),
    "mixtral (8 experts x 1536)": ("mixtral", {"num_local_experts": 8, **MOE}),
    "qwen3-moe (8 experts x 768)": (
        "qwen3_moe",
        {"num_experts": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, **MOE},
    ),
}
PROMPT = 64


def checkpoint(folder: Path, model_type: str, extra: dict, layers: int) -> Path:
    config = AutoConfig.for_model(model_type, **{**SHAPE, "num_hidden_layers": layers, **extra})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = resolve_model_path("default")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    return folder


def decode_step_ms(scheduler: Scheduler, batch: int, steps: int) -> float:
    """Median time of a decode-only `step()` with `batch` requests running."""
    params = SamplingParams.from_dict(
        {"max_new_tokens": steps + 2, "temperature": 0, "ignore_eos": True}
    )
    for i in range(batch):
        prompt = [(1000 + 97 * i + j) % 40000 + 100 for j in range(PROMPT)]
        scheduler.add_request(scheduler.make_request(f"r{i}", prompt, params))
    times = []
    while scheduler.has_work():
        start = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - start)
    scheduler.flush_cache()
    decode = times[-steps:]  # the prefill steps come first
    return 1000 * statistics.median(decode)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"| family ({args.layers} layers) | batch 1 | batch 32 |\n|---|---|---|")
    for name, (model_type, extra) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = checkpoint(Path(tmp), model_type, extra, args.layers)
            scheduler = Scheduler.from_server_args(
                ServerArgs(
                    model=str(folder),
                    attention_backend="torch",
                    max_total_tokens=8192,
                    log_level="warning",
                )
            )
            decode_step_ms(scheduler, 4, 4)  # warm-up: the C glue built, oneDNN's kernels chosen
            ms = [
                min(decode_step_ms(scheduler, b, args.steps) for _ in range(args.repeats))
                for b in (1, 32)
            ]
        print(f"| {name} | {ms[0]:.1f} ms | {ms[1]:.1f} ms |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
