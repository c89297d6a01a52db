"""What every suite's output carries: the run's `Setup` (everything needed to reproduce or
compare it), and `BenchRun`, the config, setup and output folder a suite runs and writes with."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixrt.bench.config import BenchConfig
from radixrt.bench.floors import MachineRates
from radixrt.bench.results import RunResult
from radixrt.bench.systems import Servers
from radixrt.bench.table import baseline_of, print_table

PACKAGES = (
    "radixrt",
    "torch",
    "transformers",
    "outlines-core",
    "pyzmq",
    "triton",
    "llama-cpp-python",
)  # whose versions a result records


@dataclass(frozen=True)
class Setup:
    """Everything needed to reproduce or compare a run (each result file's "setup")."""

    command: str
    model: str
    dtype: str
    max_total_tokens: int | None
    cpu: str
    cores: int | None
    gpu: str | None
    versions: dict[str, str]
    git_commit: str | None
    time: str
    machine_rates: MachineRates | None = None  # request workloads: measured before their runs

    @classmethod
    def collect(cls, config: BenchConfig, model_dir: Path) -> Setup:
        import torch

        return cls(
            command=" ".join(["radixrt bench", *config.to_cli_args()]),
            model=str(model_dir),
            dtype=config.dtype,
            max_total_tokens=config.max_total_tokens,
            cpu=_cpu_name(),
            cores=os.cpu_count(),
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            versions=_versions(),
            git_commit=_git_commit(),
            time=time.strftime("%Y-%m-%d %H:%M:%S"),
        )


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return versions


def _cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    if not Path("/proc/cpuinfo").exists():
        return cpu
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


@dataclass(frozen=True)
class BenchRun:
    """One `radixrt bench` invocation as a suite sees it: its config, its setup, the folder its
    results go to (made before the suite runs) and its radixrt servers (`run_bench` closes them
    when the suite ends)."""

    config: BenchConfig
    setup: Setup
    out_dir: Path
    servers: Servers = field(default_factory=Servers)

    def write(self, name: str, payload: dict[str, Any]) -> None:
        """`payload` with the setup first, as `<out_dir>/<name>.json`."""
        path = self.out_dir / f"{name}.json"
        path.write_text(json.dumps({"setup": asdict(self.setup), **payload}, indent=2, default=str))
        print(f"results written to {path}")

    def report(self, workload: str, systems: list[str], results: list[RunResult]) -> None:
        """A request or program workload's table and JSON file (`<workload>-sweep.json` for a
        rate sweep). Each result carries vLLM's flat keys beside its own figures, and a file of
        one result carries them at the top too (`jq .mean_ttft_ms` reads it as vLLM's)."""
        print_table(workload, results, baseline_of(results, systems))
        config = self.config
        self.write(
            f"{workload}-sweep" if config.rates else workload,
            {
                **(results[0].vllm_metrics() if len(results) == 1 else {}),
                "workload": workload,
                "config": asdict(config.shape),
                "slo": asdict(config.slo),
                "results": [{**asdict(r), **r.vllm_metrics()} for r in results],
            },
        )
