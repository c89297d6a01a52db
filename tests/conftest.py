"""Shared fixtures: the default model, a tiny seeded random Llama, and transformers references."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as `python -m pytest` in the checkout, the working directory heads sys.path, and its
# top-level kernels/ would take the name of Hugging Face's `kernels`, which transformers imports:
# the tests import radixrt.kernels, and the processes they start run without it (PYTHONSAFEPATH).
sys.path[:] = [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parents[1].resolve()
]
os.environ["PYTHONSAFEPATH"] = "1"

# The Triton kernels run interpreted in the tests (on the CPU too). It must be set before
# triton.jit decorates them, i.e. before any test module imports the Triton backend.
os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist the workers, and the runtimes each one starts, share this machine's cores:
# each worker takes its share as OMP_NUM_THREADS (torch reads it at import, a runtime's
# --cpu-threads 0 from its environment). Two workers each running torch on every core spin-wait on
# each other's threads: a module's tests took 2.7 times as long (docs/development.md, "Suite time").
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS))
    )

import shutil
from collections import defaultdict

import pytest
import torch

if XDIST_WORKERS > 1:  # in case a plugin imported torch before the share was set
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from runtimes import RuntimeFactory

from radixrt.executor.model_loader import default_gguf_path

from helpers import TINY, float_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODEL_FIXTURES = {
    "default_model_dir",
    "tiny_model_dir",
    "small_model_dir",
}  # the runtimes below use them


def pytest_collection_modifyitems(items) -> None:
    """Mark `model` every test that needs a model, directly or through its fixtures, so that
    `make test-fast` (`-m "not model"`) runs the rest in the edit-test loop."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


SECONDS_BY_DIRECTORY: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    """Add each phase's time (setup, call, teardown) to its test's directory; under xdist the
    controller receives every worker's reports here too."""
    SECONDS_BY_DIRECTORY[report.nodeid.split("::")[0].rpartition("/")[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The suite's time per test directory (docs/development.md keeps the figures), summed over
    xdist workers, so the total may exceed the wall clock."""
    if not SECONDS_BY_DIRECTORY:
        return
    terminalreporter.write_sep("=", "time per test directory (summed over workers)")
    for directory, seconds in sorted(SECONDS_BY_DIRECTORY.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {directory}")
    terminalreporter.write_line(f"{sum(SECONDS_BY_DIRECTORY.values()):8.1f}s  in all")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model as a float32 checkpoint beside its GGUF's config and tokenizer:
    transformers' references load it, and a runtime given its path serves it float."""
    return float_checkpoint(default_gguf_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random Llama (GQA, seeded) with the default model's tokenizer, as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**TINY, max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """The default model's first layers, float: a trained model small enough to quantize in
    seconds (tests/executor/test_prequantized*.py)."""
    from quant_packers import write_small_model

    return write_small_model(default_model_dir, tmp_path_factory.mktemp("small-model"))


@pytest.fixture(scope="module")
def quality_reference(default_model_dir):
    """float32 on the default model over the quality text, what quantized weights are held
    against (`helpers.quality_gates`). Per module: a float model kept alive past its module
    would be in the way of tests that look for float copies left after a quantized load."""
    from helpers import QualityReference

    return QualityReference.of_default_model()


@pytest.fixture(scope="session")
def runtimes(tiny_model_dir):
    """The factory every test's shared runtime comes from (`runtimes.RuntimeFactory`): a lease
    with the settings of a live one gets that one."""
    factory = RuntimeFactory(keep_idle_for=tiny_model_dir)
    yield factory
    factory.close()


# Runtimes for every module that needs no settings of its own.
@pytest.fixture(scope="session")
def tiny_runtime(runtimes, tiny_model_dir):
    """The tiny model behind ZeroMQ and HTTP (served as "tiny"), a 4096-token pool."""
    with runtimes.lease(
        tiny_model_dir, http=True, max_total_tokens=4096, served_model_name="tiny"
    ) as r:
        yield r


@pytest.fixture(scope="session")
def default_runtime(runtimes, default_model_dir):
    """The default model behind ZeroMQ and HTTP, an 8192-token pool."""
    with runtimes.lease(default_model_dir, http=True, max_total_tokens=8192) as r:
        yield r
