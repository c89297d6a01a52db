"""What `--kv-cache-dtype` buys on the default model: tokens the pool holds in a fixed memory
budget, the host and disk tiers' bytes per token, and the decode step at long contexts against
float32 KV (the model's forward alone: the pool is filled with random K/V, written through the
pool's own `set_kv`, so no prefill is timed or needed).

    .venv/bin/python scripts/kv_cache_dtype.py --context 2048 8000 --batch 1
"""

from __future__ import annotations

import argparse
import time

import torch
from safetensors.torch import save as save_safetensors

from radixrt.config import ServerArgs
from radixrt.executor.model_runner import ModelRunner
from radixrt.forward_batch import ForwardBatch
from radixrt.mem_cache.storage import STORAGE_BLOCK_TOKENS

DTYPES = ("auto", "int8", "fp8_e4m3")
BUDGET_GB = 1.0


def disk_bytes_per_token(runner: ModelRunner) -> float:
    """A disk block's file (its K and V as safetensors, as the disk tier writes them) per token."""
    pool = runner.kv_pool
    shape = (pool.num_layers, STORAGE_BLOCK_TOKENS, *pool.shape[1:])
    block = torch.zeros(shape, dtype=pool.k_buffers[0].dtype)
    data = save_safetensors({"k": block, "v": block.clone()}, {"checksum": "0" * 64})
    return len(data) / STORAGE_BLOCK_TOKENS


def fill(runner: ModelRunner, tokens: int) -> None:
    """Random K/V rows (the scale of real keys) in slots 1..tokens of every layer."""
    pool = runner.kv_pool
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.num_layers):
        for start in range(1, tokens + 1, 4096):
            n = min(4096, tokens + 1 - start)
            k = torch.randn(n, pool.shape[1], pool.head_dim, generator=gen) * 3
            v = torch.randn(n, pool.shape[1], pool.head_dim, generator=gen)
            pool.set_kv(layer, torch.arange(start, start + n), k, v)


def decode_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """The best of `steps` decode steps of `batch` requests, each over `context` keys."""
    rows = torch.arange(1, batch + 1)
    per = context + 1
    for b in range(batch):  # request b's keys: its own run of slots
        runner.req_to_token_pool.req_to_token[b + 1, :per] = torch.arange(
            1 + b * per, 1 + (b + 1) * per, dtype=torch.int32
        )
    out_slots = torch.tensor([1 + b * per + context for b in range(batch)])
    best = float("inf")
    for _ in range(steps + 1):
        forward = ForwardBatch(
            torch.full((batch,), 1000),
            torch.full((batch,), context),
            out_slots,
            rows,
            [context] * batch,
            [1] * batch,
        )
        start = time.perf_counter()
        runner.logits(runner.forward(forward))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    need = max(args.batch) * (max(args.context) + 1) + 8
    for name in DTYPES:
        runner = ModelRunner(ServerArgs(max_total_tokens=need, kv_cache_dtype=name).executor)
        per_token = runner.kv_pool.bytes_per_token
        print(
            f"{name}: {per_token} B/token in the pool and the host tier, "
            f"{disk_bytes_per_token(runner):.0f} B/token on disk, "
            f"{int(BUDGET_GB * 2**30 / per_token):,} tokens in {BUDGET_GB:g} GiB",
            flush=True,
        )
        fill(runner, need - 1)
        for context in args.context:
            for batch in args.batch:
                ms = decode_ms(runner, batch, context, args.steps)
                print(f"  decode step, batch {batch}, context {context}: {ms:.1f} ms", flush=True)
        del runner


if __name__ == "__main__":
    main()
