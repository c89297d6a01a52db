"""`--kv-cache-dtype int8` through every memory tier on the tiny model: a request's quantized
rows (codes and scales) are written once and then reused as they are, from the radix tree, the
host tier, the disk tier after a restart and a swap, so every path gives the cold answer token
for token; the attention paths that read a quantized pool, and a refusal at start where one
cannot."""

from __future__ import annotations

import random
import subprocess

import pytest
import torch

from radixrt.mem_cache.kv_quant import KVFormat, resolve_kv_format

from helpers import assert_tiers_free, serve_argv, tier_engine

GREEDY = {"temperature": 0, "ignore_eos": True}
INT8 = {"kv_cache_dtype": "int8", "enable_hierarchical_cache": True}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(length)] for _ in range(n)]


def test_int8_rows_are_reused_as_written_through_every_tier(tiny_model_dir, tmp_path):
    """One 200-token prompt cold, warm (a radix hit), from the host tier once other prompts
    pushed it out of the pool, and from disk after a restart: the same 16 tokens each time.
    Then six requests that do not fit the pool together, swapped out and back in: each
    answer is the one it gets alone. model_info reports the pool as built."""
    prompt = _prompts(1, 200, 0)[0]
    others = _prompts(3, 250, 1)
    batch = _prompts(6, 30, 2)
    sampling = {**GREEDY, "max_new_tokens": 16}
    tier = {**INT8, "hicache_storage_dir": str(tmp_path), "hicache_ratio": 4}
    with tier_engine(tiny_model_dir, **tier, max_total_tokens=320) as engine:
        info = engine.model_info
        cold = engine.generate(input_ids=prompt, sampling_params=sampling)
        warm = engine.generate(input_ids=prompt, sampling_params=sampling)
        for other in others:
            engine.generate(input_ids=other, sampling_params=sampling)
        host = engine.generate(input_ids=prompt, sampling_params=sampling)
        alone = [
            engine.generate(input_ids=p, sampling_params={**sampling, "max_new_tokens": 40})
            for p in batch
        ]
        assert_tiers_free(engine)
    assert info["kv_cache_dtype"] == "int8" and info["max_total_num_tokens"] == 320
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # layers, K and V, heads, row
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= 192
    assert host["meta_info"]["host_cached_tokens"] >= 192
    with tier_engine(tiny_model_dir, **tier, max_total_tokens=320) as engine:  # a restart
        disk = engine.generate(input_ids=prompt, sampling_params=sampling)
    assert disk["meta_info"]["storage_cached_tokens"] == 192
    for path in (warm, host, disk):
        assert path["output_ids"] == cold["output_ids"]

    swap = {**INT8, "preemption_mode": "swap", "max_running_requests": 8}
    with tier_engine(
        tiny_model_dir, **swap, max_total_tokens=128, chunked_prefill_size=32
    ) as engine:
        swapped = engine.generate(
            input_ids=batch, sampling_params={**sampling, "max_new_tokens": 40}
        )
        stats = engine.stats()
        assert_tiers_free(engine)
    assert stats["num_preemptions"] > 0 and stats["swapped_in_tokens"] > 0
    assert [o["output_ids"] for o in swapped] == [o["output_ids"] for o in alone]


def test_a_kv_dtype_the_attention_path_cannot_read_is_refused_at_start(tiny_model_dir):
    """The deterministic mode's fixed-order attention reads float32 rows only: `serve
    --kv-cache-dtype fp8_e4m3 --enable-deterministic-inference` exits at start with one line
    naming both flags."""
    argv = serve_argv(tiny_model_dir, "--kv-cache-dtype", "fp8_e4m3")
    argv += ["--enable-deterministic-inference", "--max-total-tokens", "64"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("radixrt serve: error: --enable-deterministic-inference ")
    assert "needs --kv-cache-dtype auto" in last


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_paths_that_read_a_quantized_pool(fmt):
    """The torch backend on the CPU and the Triton kernels (CUDA's default, or on the CPU under
    the interpreter) read every format; the torch backend on CUDA is refused in one line."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for device, backend in [(cpu, "auto"), (cpu, "torch"), (cpu, "triton"), (cuda, "auto")]:
        assert resolve_kv_format(fmt, device, backend) is KVFormat(fmt)
    assert resolve_kv_format("auto", cuda, "torch") is None
    with pytest.raises(ValueError, match=f"^--kv-cache-dtype {fmt}: the torch attention backend"):
        resolve_kv_format(fmt, cuda, "torch")
