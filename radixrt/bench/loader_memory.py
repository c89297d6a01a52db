"""The loader's peak host memory against the weights' size (`load_model` in a fresh interpreter):
the measurement the loader test holds to 1.2x, and `python -m radixrt.bench.loader_memory FOLDER
DTYPE` at any size (docs/benchmarks.md has the 1B-class figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Runs in a fresh interpreter: everything imported first, the RSS noted, the model loaded, then
# the high-water mark read. Prints the peak growth, the weights' bytes and a spot check. The
# mark is VmHWM, this address space's own: ru_maxrss keeps the parent's peak across fork and
# exec, so under pytest it would report the test process's memory.
MEASURE = """
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from transformers import AutoConfig
from radixrt.distributed.group import TPGroup
from radixrt.executor.model_loader import load_model

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

folder, dtype = Path(sys.argv[1]), getattr(torch, sys.argv[2])
config, tp = AutoConfig.from_pretrained(folder), TPGroup()
base = status("VmRSS:")
model = load_model(folder, config, 1024, tp, dtype)
peak = status("VmHWM:")
with safe_open(folder / "model.safetensors", framework="pt") as f:
    stored = f.get_tensor("model.layers.3.mlp.up_proj.weight").to(dtype)
loaded = model.layers[3].mlp.gate_up_proj.weight[config.intermediate_size :]
print(json.dumps({
    "growth": peak - base,
    "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
    "same": bool(torch.equal(loaded, stored)),
}))
"""


@dataclass(frozen=True)
class LoadMemory:
    """Peak RSS growth over the RSS after imports, the weights' bytes in the dtype, and whether
    a spot-checked tensor loaded equal to the stored one."""

    growth: int
    weights: int
    same: bool

    @property
    def ratio(self) -> float:
        return self.growth / self.weights


def measure(folder: Path, dtype: str, timeout: float = 1800) -> LoadMemory:
    """Load `folder` (a Llama checkpoint in one model.safetensors) in `dtype` in a fresh
    interpreter and read its peak."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder), dtype],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return LoadMemory(**json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    result = measure(Path(sys.argv[1]), sys.argv[2])
    print(
        f"{sys.argv[2]}: weights {result.weights / 1e6:.0f} MB, peak RSS growth "
        f"{result.growth / 1e6:.0f} MB: {result.ratio:.3f}x (spot check equal: {result.same})"
    )
