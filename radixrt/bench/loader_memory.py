"""The loader's peak host memory against the weights' size (`load_model` in a fresh interpreter):
the measurement the loader test holds to 1.2x, and `python -m radixrt.bench.loader_memory FOLDER
DTYPE [int8|int4]` at any size (docs/benchmarks.md has the 1B-class figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from radixrt.lifecycle import python_command

# Runs in a fresh interpreter: everything imported first (and the model built on the meta device,
# for its largest linear), the RSS noted, the model loaded (its linears packed as they are read,
# under int8 or int4), then the high-water mark read. Prints the peak growth, the bytes the model
# holds, its largest linear's float bytes, and a spot check. The
# mark is VmHWM, this address space's own: ru_maxrss keeps the parent's peak across fork and
# exec, so under pytest it would report the test process's memory.
MEASURE = """
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig
from radixrt.distributed.group import TPGroup
from radixrt.executor.model_loader import load_model
from radixrt.executor.model_runner import linear_bytes
from radixrt.kernels.cpu_isa import Isa
from radixrt.models import model_class
from radixrt.models.linear import LinearPacking

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

folder, dtype = Path(sys.argv[1]), getattr(torch, sys.argv[2])
packing = LinearPacking(sys.argv[3], Isa.AVX2) if sys.argv[3] != "float" else None
config, tp = AutoConfig.from_pretrained(folder), TPGroup()
with torch.device("meta"):
    built = model_class(config)(config, 1024, tp)
linears = [m.weight.numel() for m in built.modules() if isinstance(m, nn.Linear)]
largest = max(linears) * dtype.itemsize
base = status("VmRSS:")
model = load_model(folder, config, 1024, tp, dtype, packing=packing)
peak = status("VmHWM:")
name = "model.layers.3.mlp.{}_proj.weight"
with safe_open(folder / "model.safetensors", framework="pt") as f:
    stored = torch.cat([f.get_tensor(name.format(p)) for p in ("gate", "up")]).to(dtype)
loaded = model.layers[3].mlp.gate_up_proj
if packing is None:
    same = torch.equal(loaded.weight, stored)
else:
    want = packing.pack("layers.3.mlp.gate_up_proj", stored)
    same = torch.equal(loaded.weight.tiles, want.tiles) and torch.equal(loaded.weight.scales, want.scales)
others = [p for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)]
print(json.dumps({
    "growth": peak - base,
    "weights": linear_bytes(model) + sum(p.numel() * p.element_size() for p in others),
    "largest": largest,
    "same": bool(same),
}))
"""


@dataclass(frozen=True)
class LoadMemory:
    """Peak RSS growth over the RSS after imports, the bytes the loaded model holds (its
    parameters in the dtype, its linears packed under a quantization), the float bytes of its
    largest linear (the packing loader's one buffer), and whether a spot-checked weight loaded
    equal to the stored one (packed: to the stored one packed whole)."""

    growth: int
    weights: int
    largest: int
    same: bool

    @property
    def ratio(self) -> float:
        return self.growth / self.weights


def measure(
    folder: Path, dtype: str, quantization: str = "float", timeout: float = 1800
) -> LoadMemory:
    """Load `folder` (a Llama checkpoint in one model.safetensors) in `dtype`, its linears packed
    under `quantization` (int8, int4; float: as they are), in a fresh interpreter and read its
    peak."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        python_command("-c", MEASURE, str(folder), dtype, quantization),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return LoadMemory(**json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    quantization = sys.argv[3] if len(sys.argv) > 3 else "float"
    result = measure(Path(sys.argv[1]), sys.argv[2], quantization)
    print(
        f"{sys.argv[2]} {quantization}: held {result.weights / 1e6:.0f} MB, peak RSS growth "
        f"{result.growth / 1e6:.0f} MB: {result.ratio:.3f}x (spot check equal: {result.same})"
    )
