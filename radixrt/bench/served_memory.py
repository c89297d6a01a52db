"""Host memory of a model served on the CPU, by part: `python -m radixrt.bench.served_memory
MODEL [--quantization int8|int4|gguf] [--max-total-tokens N]` builds a `ModelRunner` in a fresh
interpreter, prefills 32 tokens and decodes a few greedily, and reports the peak RSS of the load
and of the whole run (Linux VmHWM) beside what the parts hold: the linears as served (packed or
float), the other parameters (embedding, norms), the KV pool, the tokenizer (loaded alone first)
and the interpreter with its imports. docs/benchmarks.md ("Memory at served size") has figures.
`loader_memory` measures the float loader alone."""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixrt.lifecycle import python_command

# Runs in a fresh interpreter, so that the peak is this run's own (see loader_memory.MEASURE).
SERVED = """
import json, sys
import torch
from transformers import AutoTokenizer
from radixrt.config import ServerArgs
from radixrt.executor.model_loader import resolve_model_path
from radixrt.executor.model_runner import ModelRunner, linear_bytes
from radixrt.forward_batch import ForwardBatch

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

settings, new_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
base = status("VmRSS:")
tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings["model"]))
tokenizer_bytes = status("VmRSS:") - base
del tokenizer
runner = ModelRunner(ServerArgs(**settings).executor)
loaded, load_peak = status("VmRSS:"), status("VmHWM:")
table, prompt = runner.req_to_token_pool.req_to_token, 32
table[1, : prompt + new_tokens] = torch.arange(1, prompt + new_tokens + 1, dtype=torch.int32)
step = ForwardBatch(torch.arange(100, 100 + prompt), torch.arange(prompt),
                    torch.arange(1, prompt + 1), torch.tensor([1]), [0], [prompt])
tokens = []
for at in range(prompt, prompt + new_tokens):
    tokens.append(int(runner.logits(runner.forward(step))[-1].argmax()))
    step = ForwardBatch(torch.tensor(tokens[-1:]), torch.tensor([at]), torch.tensor([at + 1]),
                        torch.tensor([1]), [at], [1])
pool = runner.kv_pool
print(json.dumps({
    "base": base,
    "tokenizer": tokenizer_bytes,
    "loaded": loaded,
    "load_peak": load_peak,
    "served": status("VmRSS:"),
    "served_peak": status("VmHWM:"),
    "linears": linear_bytes(runner.model),
    "params": sum(p.nbytes for p in runner.model.parameters() if not p.is_meta),
    "kv_capacity": sum(b.nbytes for b in pool.k_buffers + pool.v_buffers),
    # resident: the pages of the slots written (0 .. prompt + new tokens), in every buffer
    "kv_pool": sum(-(-(prompt + new_tokens + 1) * b[0].nbytes // 4096) * 4096
                   for b in pool.k_buffers + pool.v_buffers),
    "tokens": tokens,
}))
"""


@dataclass(frozen=True)
class ServedMemory:
    """Bytes, all of them: RSS after imports (`base`), the tokenizer's growth alone, RSS after
    the load and its peak, RSS after the steps and the run's peak; what the linears, the other
    parameters and the KV pool hold (`kv_pool`: the pages written, which alone are resident;
    `kv_capacity`: its size); and the greedy tokens decoded (for comparing runs)."""

    base: int
    tokenizer: int
    loaded: int
    load_peak: int
    served: int
    served_peak: int
    linears: int
    params: int
    kv_pool: int
    kv_capacity: int
    tokens: list[int]


def measure(settings: dict[str, Any], new_tokens: int = 8, timeout: float = 1800) -> ServedMemory:
    """Serve `settings` (`ServerArgs` keywords: model, quantization, max_total_tokens, ...) in a
    fresh interpreter and read its memory."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        python_command("-c", SERVED, json.dumps(settings), str(new_tokens)),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return ServedMemory(**json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", choices=["int8", "int4", "gguf"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    settings = {"model": args.model, "quantization": args.quantization, "dtype": args.dtype}
    if args.max_total_tokens is not None:
        settings["max_total_tokens"] = args.max_total_tokens
    r = measure(settings, args.new_tokens)
    mb = 1e6
    print(
        f"{args.model} {args.quantization or args.dtype}: peak RSS {r.served_peak / mb:.0f} MB"
        f" (load {r.load_peak / mb:.0f}), after the run {r.served / mb:.0f} MB = imports"
        f" {r.base / mb:.0f} + linears {r.linears / mb:.0f} + other parameters"
        f" {r.params / mb:.0f} + KV pool {r.kv_pool / mb:.0f} (written, of"
        f" {r.kv_capacity / mb:.0f}) + rest"
        f" {(r.served - r.base - r.linears - r.params - r.kv_pool) / mb:.0f}"
        f" (tokenizer alone {r.tokenizer / mb:.0f}); greedy tokens {r.tokens}"
    )


if __name__ == "__main__":
    main()
