"""`--cpu-isa`: the path the CPU's quantized linears take. A path the host cannot run is refused
at start in one line (here: `avx2` in a process without a C compiler), `auto` takes the best the
host runs (torch with one warning where that is all), and `model_info` names the path taken. The
torch path multiplies the same packed weights, dequantized, so it agrees with the kernels' up to
their 8-bit activations. `--cpu-threads`: the kernels' threads, the physical cores by
default."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import radixrt as rt
from radixrt.config import ServerArgs, physical_cores
from radixrt.executor.model_runner import ModelRunner
from radixrt.executor.tp_worker import threads_per_rank
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_isa
from radixrt.kernels.cpu_isa import Isa
from radixrt.models.linear import GroupedLinear

from timeouts import REPLY_TIMEOUT_S

needs_avx2 = pytest.mark.skipif(
    Isa.AVX2 not in cpu_isa.host_paths(), reason="needs AVX2 and a C compiler"
)


def test_the_flag_offers_the_kernels_paths():
    assert ServerArgs.__dataclass_fields__["cpu_isa"].metadata["choices"] == tuple(cpu_isa.CHOICES)


def test_auto_takes_the_best_path_and_warns_once_when_only_torch_is_left(caplog):
    assert cpu_isa.resolve("auto", [Isa.AVX512_VNNI, Isa.AVX2, Isa.TORCH]) is Isa.AVX512_VNNI
    assert cpu_isa.resolve("auto", [Isa.AVX2, Isa.TORCH]) is Isa.AVX2
    with caplog.at_level(logging.WARNING, logger="radixrt.kernels.cpu_isa"):
        assert cpu_isa.resolve("auto", [Isa.TORCH]) is Isa.TORCH
    assert len(caplog.records) == 1 and "lacks AVX2" in caplog.records[0].getMessage()


def test_a_path_the_host_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        cpu_isa.resolve("avx2", [Isa.TORCH])
    assert str(refused.value) == (
        "--cpu-isa avx2: this host cannot run it (it needs the CPU flags avx2 f16c fma and a C"
        " compiler; this host runs: torch)"
    )
    with pytest.raises(ValueError) as refused:
        cpu_isa.resolve("avx512-vnni", [Isa.AVX2, Isa.TORCH])
    assert str(refused.value) == (
        "--cpu-isa avx512-vnni: this host cannot run it (it needs the CPU flags avx2 avx512_vnni"
        " avx512bw avx512f avx512vl f16c fma and a C compiler; this host runs: avx2, torch)"
    )
    with pytest.raises(ValueError) as refused:  # an AVX-512 host without AVX-VNNI
        cpu_isa.resolve("avx-vnni", [Isa.AVX512_VNNI, Isa.AVX2, Isa.TORCH])
    assert str(refused.value) == (
        "--cpu-isa avx-vnni: this host cannot run it (it needs the CPU flags avx2 avx_vnni f16c"
        " fma and a C compiler; this host runs: avx512-vnni, avx2, torch)"
    )
    with pytest.raises(ValueError) as refused:  # a CPU without AMX, or an OS that withholds it
        cpu_isa.resolve("amx", [Isa.AVX512_VNNI, Isa.AVX2, Isa.TORCH])
    assert str(refused.value) == (
        "--cpu-isa amx: this host cannot run it (it needs the CPU flags amx_int8 amx_tile avx2"
        " avx512_vnni avx512bw avx512f avx512vl f16c fma, the OS's grant of the tile state, and a"
        " C compiler; this host runs: avx512-vnni, avx2, torch)"
    )
    with pytest.raises(ValueError, match="no path"):
        cpu_isa.resolve("avx512", [Isa.AVX2, Isa.TORCH])


def test_host_paths_follow_the_cpu_flags():
    """The native paths listed are those whose flags this CPU has, best first, then torch;
    AMX also needs the OS to grant this process the tile state, which Linux does when asked."""
    flags = cpu_isa.cpu_flags()
    expected = [isa for isa, needs in cpu_isa.NEEDS.items() if needs <= flags]
    if Isa.AMX in expected:
        assert cpu_isa.amx_granted()  # Linux 5.16+ on an AMX CPU grants it
    assert cpu_isa.host_paths() == [*expected, Isa.TORCH]


def test_a_host_without_a_compiler_refuses_avx2_at_start(tiny_model_dir, tmp_path):
    """Real processes with no C compiler ($CC names none): `radixrt serve --cpu-isa avx2` exits
    at start with one line saying why; under `auto` the model runner falls back to torch with
    one warning."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler")}
    serve = [sys.executable, "-m", "radixrt", "serve", "--model", str(tiny_model_dir)]
    serve += ["--quantization", "int4", "--cpu-isa", "avx2", "--max-total-tokens", "64"]
    refused = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("radixrt serve: error: --cpu-isa avx2: this host cannot run it (")
    script = (
        "import sys\n"
        "from radixrt.config import ServerArgs\n"
        "from radixrt.executor.model_runner import ModelRunner\n"
        "args = ServerArgs(model=sys.argv[1], max_total_tokens=64, quantization='int4')\n"
        "print('path', ModelRunner(args.executor).cpu_isa.value)\n"
    )
    fallback = _python(script, tiny_model_dir, env)
    assert "path torch" in fallback.stdout
    assert fallback.stderr.count("quantized linears run in torch") == 1


@needs_avx2
def test_the_torch_path_multiplies_the_same_weights(tiny_model_dir):
    """int4 under `torch`: every quantized linear takes the torch path over the same packed
    weights, and agrees with the kernel's up to its 8-bit activations (within 5% of the largest
    output on this random model's wide weights); the model's forward runs on it. (Logits are
    not compared: these weights amplify any rounding through the layers.)"""
    args = ServerArgs(
        model=str(tiny_model_dir), max_total_tokens=256, quantization="int4", cpu_isa="torch"
    )
    runner = ModelRunner(args.executor)
    linears = [m for m in runner.model.modules() if isinstance(m, GroupedLinear)]
    assert runner.cpu_isa is Isa.TORCH and linears and all(m.isa is Isa.TORCH for m in linears)
    assert runner.kv_numerics == "int4, dequantized in torch"  # the disk tier keeps it apart
    x = torch.randn(5, linears[0].weight.in_features)
    kernel = GroupedLinear(linears[0].weight, linears[0].bias, Isa.AVX2)
    scale = float(linears[0](x).abs().max())
    torch.testing.assert_close(kernel(x), linears[0](x), rtol=0, atol=0.05 * scale)
    assert torch.isfinite(_forward_logits(runner)).all()


def _forward_logits(runner: ModelRunner, n: int = 12) -> torch.Tensor:
    """The logits of one `n`-token prefill through `runner`'s model."""
    slots = torch.arange(1, n + 1)
    runner.req_to_token_pool.req_to_token[1, :n] = slots.to(torch.int32)
    batch = ForwardBatch(
        torch.arange(5, 5 + n), torch.arange(n), slots, torch.tensor([1]), [0], [n]
    )
    return runner.logits(runner.forward(batch))


@pytest.mark.parametrize("isa", [Isa.AMX, Isa.AVX512_VNNI, Isa.AVX_VNNI])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_every_path_serves_the_bits_of_the_avx2_path(tiny_model_dir, quantization, isa):
    """A model's forward under each `--cpu-isa` path gives avx2's logits bit for bit: the same
    packed weights, the same activations, integer sums that are exact on every path, the same
    float operations after them (a 40-token prefill: AMX's tiles take 16 rows and more). So
    the disk tier's fingerprint names none (`kv_numerics`): any host reads another's KV."""
    if isa not in cpu_isa.host_paths():
        pytest.skip(f"this CPU lacks {isa.value}")
    logits = {}
    for name in (isa.value, "avx2"):
        args = ServerArgs(
            model=str(tiny_model_dir), max_total_tokens=256, quantization=quantization, cpu_isa=name
        )
        runner = ModelRunner(args.executor)
        assert runner.cpu_isa is Isa(name) and runner.kv_numerics == quantization
        logits[name] = _forward_logits(runner, 40)
    assert torch.equal(logits[isa.value], logits["avx2"])


@needs_avx2
def test_model_info_names_the_path_taken(tiny_model_dir):
    kwargs = dict(model=str(tiny_model_dir), max_total_tokens=256, log_level="warning")
    with rt.Engine(**kwargs, quantization="int4", timeout=REPLY_TIMEOUT_S) as engine:
        assert engine.model_info["cpu_isa"] == cpu_isa.host_paths()[0].value
        assert engine.model_info["quantization"] == "int4"
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2


def test_threads_default_to_the_physical_cores_and_split_over_ranks(monkeypatch):
    """`--cpu-threads` 0 takes OMP_NUM_THREADS where set, else the physical cores this process
    may run on (never more than the processors it may use); each local rank takes its share."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2, cpu_threads=6) == 3
    assert threads_per_rank(4, cpu_threads=2) == 1  # never none
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(1) == 3 and threads_per_rank(1, cpu_threads=1) == 1


def test_a_runtime_takes_the_threads_it_is_given(tiny_model_dir):
    """A real process that starts a runtime with `--cpu-threads 1` runs its model on one
    thread, whatever the host has."""
    script = (
        "import sys, torch\n"
        "from radixrt.config import ServerArgs\n"
        "from radixrt.executor.tp_worker import TPDriver\n"
        "args = ServerArgs(model=sys.argv[1], max_total_tokens=64, cpu_threads=1)\n"
        "TPDriver.start(args.executor)\n"
        "print('threads', torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert "threads 1" in _python(script, tiny_model_dir, env).stdout


def _python(script: str, model_dir, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`script` run by a fresh interpreter with the model's folder as its argument, under
    `env`; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done
