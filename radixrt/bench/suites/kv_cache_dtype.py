"""`--workload kv-cache-dtype`: what `--kv-cache-dtype` buys on `--model`: the tokens its pool
holds in a fixed memory budget (BUDGET_GIB), the host and disk tiers' bytes per token, and the
decode forward at long contexts against the model's own dtype (`auto`). The model's forward
alone is timed, not a scheduler's step: the pool is filled with random K/V written through the
pool's own `set_kv`, so no prefill is timed or needed. At each of `--batches` (1,4) and
`--contexts` (2048,8000 keys a request), the best of `--steps` (5) forwards, after a warm one.
Into `kv-cache-dtype.json`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

if TYPE_CHECKING:  # the model runner (torch) loads only when the suite runs
    from radixrt.executor.model_runner import ModelRunner

DTYPES = ("auto", "int8", "fp8_e4m3")
BUDGET_GIB = 1.0
FILL_CHUNK = 4096  # rows written to the pool at once


@dataclass(frozen=True)
class Forward:
    """The best decode forward of `batch` requests, each over `context` keys."""

    batch: int
    context: int
    best_s: float


@dataclass(frozen=True)
class KvDtype:
    """One `--kv-cache-dtype`: bytes per token in the pool (and the host tier, which moves the
    same), in a disk block's file, the tokens BUDGET_GIB holds, and its forwards."""

    kv_cache_dtype: str
    pool_bytes_per_token: int
    disk_bytes_per_token: float
    tokens_in_budget: int
    forwards: list[Forward]


@register("kv-cache-dtype")
def run_kv_cache_dtype(run: BenchRun) -> dict[str, list[RunResult]]:
    config = run.config
    batches, contexts = config.batch_sizes or [1, 4], config.context_lens or [2048, 8000]
    rows = [_measure(run, name, batches, contexts) for name in DTYPES]
    run.write(
        "kv-cache-dtype",
        {
            "workload": "kv-cache-dtype",
            "budget_gib": BUDGET_GIB,
            "steps": config.steps or 5,
            "results": [asdict(r) for r in rows],
        },
    )
    return {}


def _measure(run: BenchRun, name: str, batches: list[int], contexts: list[int]) -> KvDtype:
    """A runner with a `name` pool big enough for the largest batch and context, filled; its
    sizes and forwards, printed as they come."""
    from radixrt.config import ServerArgs
    from radixrt.executor.model_runner import ModelRunner

    need = max(batches) * (max(contexts) + 1) + 8
    args = ServerArgs(
        model=run.config.model, dtype=run.config.dtype, max_total_tokens=need, kv_cache_dtype=name
    )
    runner = ModelRunner(args.executor)
    per_token = runner.kv_pool.bytes_per_token
    disk = disk_bytes_per_token(runner)
    budget = int(BUDGET_GIB * 2**30 / per_token)
    print(
        f"{name}: {per_token} B/token in the pool and the host tier, {disk:.0f} B/token on disk, "
        f"{budget:,} tokens in {BUDGET_GIB:g} GiB",
        flush=True,
    )
    fill(runner, need - 1)
    forwards = []
    for context in contexts:
        for batch in batches:
            forwards.append(_forward(runner, batch, context, run.config.steps or 5))
            ms = forwards[-1].best_s * 1e3
            print(f"  decode step, batch {batch}, context {context}: {ms:.1f} ms", flush=True)
    return KvDtype(name, per_token, disk, budget, forwards)


def disk_bytes_per_token(runner: ModelRunner) -> float:
    """A disk block's file (its K and V as safetensors, as the disk tier writes them) per token."""
    import torch
    from safetensors.torch import save

    from radixrt.mem_cache.storage import STORAGE_BLOCK_TOKENS

    pool = runner.kv_pool
    shape = (pool.num_layers, STORAGE_BLOCK_TOKENS, *pool.shape[1:])
    block = torch.zeros(shape, dtype=pool.k_buffers[0].dtype)
    data = save({"k": block, "v": block.clone()}, {"checksum": "0" * 64})
    return len(data) / STORAGE_BLOCK_TOKENS


def fill(runner: ModelRunner, tokens: int) -> None:
    """Random K/V rows (the scale of real keys) in slots 1..tokens of every layer."""
    import torch

    pool = runner.kv_pool
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.num_layers):
        for start in range(1, tokens + 1, FILL_CHUNK):
            n = min(FILL_CHUNK, tokens + 1 - start)
            k = torch.randn(n, pool.shape[1], pool.head_dim, generator=gen) * 3
            v = torch.randn(n, pool.shape[1], pool.head_dim, generator=gen)
            pool.set_kv(layer, torch.arange(start, start + n), k, v)


def _forward(runner: ModelRunner, batch: int, context: int, steps: int) -> Forward:
    """The best of `steps` decode forwards (logits included) after a warm one, request b's
    keys its own run of `context` slots."""
    import torch

    from radixrt.forward_batch import ForwardBatch

    per = context + 1
    for b in range(batch):
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
            torch.arange(1, batch + 1),
            [context] * batch,
            [1] * batch,
        )
        start = time.perf_counter()
        runner.logits(runner.forward(forward))
        best = min(best, time.perf_counter() - start)
    return Forward(batch, context, best)
