"""The benchmark's arithmetic on hand-made traces, the workloads' shapes, the static schedule mode,
and a smoke run of every workload at tiny size."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoTokenizer

from radixrt.bench.floors import Floors, MachineRates
from radixrt.bench.metrics import SLO, RequestTrace, percentile, summarize
from radixrt.bench.workloads import REQUEST_WORKLOADS, WorkloadConfig
from radixrt.cli import main

from helpers import make_scheduler


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert abs(percentile(list(map(float, range(101))), 99) - 99.0) < 1e-9
    assert math.isnan(percentile([], 50))


def test_ttft_tpot_itl_from_timestamps():
    trace = RequestTrace(
        sent=10.0, chunk_times=[10.5, 10.6, 10.8], chunk_tokens=[1, 1, 2], done=10.8
    )
    assert trace.output_tokens == 4
    assert trace.ttft == pytest.approx(0.5)
    assert trace.tpot == pytest.approx(0.3 / 3)  # three tokens after the first, in 0.3 s
    assert trace.itls() == pytest.approx([0.1, 0.2])
    single = RequestTrace(sent=0.0, chunk_times=[0.2], chunk_tokens=[1], done=0.2)
    assert single.tpot is None and single.itls() == []


def test_goodput_counts_requests_meeting_both_slos():
    fast = RequestTrace(sent=0.0, chunk_times=[0.5, 0.54, 0.58], chunk_tokens=[1, 1, 1], done=0.58)
    slow_first = RequestTrace(sent=0.0, chunk_times=[1.5, 1.52], chunk_tokens=[1, 1], done=1.52)
    slow_tokens = RequestTrace(
        sent=0.0, chunk_times=[0.2, 0.4, 0.6], chunk_tokens=[1, 1, 1], done=0.6
    )
    failed = RequestTrace(sent=0.0, error="aborted")
    summary = summarize(
        [fast, slow_first, slow_tokens, failed], duration_s=2.0, slo=SLO(ttft_s=1.0, tpot_s=0.05)
    )
    assert summary.requests == 4 and summary.errors == 1
    assert summary.goodput == pytest.approx(0.5) and summary.slo_attainment == pytest.approx(0.25)
    assert summary.output_tokens == 8 and summary.output_throughput == pytest.approx(4.0)
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.ttft.p50 == pytest.approx(0.5) and summary.ttft.mean == pytest.approx(2.2 / 3)
    assert summary.itl.p99 == pytest.approx(percentile([0.04, 0.04, 0.02, 0.2, 0.2], 99))
    assert summary.tpot.p50 == pytest.approx(0.04)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_workloads_are_seeded_and_shaped(tokenizer):
    cfg = WorkloadConfig(
        num_requests=6,
        max_new_tokens=16,
        prefix_tokens=80,
        question_tokens=10,
        turns=3,
        long_prompts=2,
        long_tokens=300,
    )
    for name, make in REQUEST_WORKLOADS.items():
        assert make(tokenizer, cfg) == make(tokenizer, cfg), name
    prompts = [s.turns[0].text for s in REQUEST_WORKLOADS["shared-prefix"](tokenizer, cfg)]
    shared = len(tokenizer.encode(prompts[0][: min(map(len, prompts))].rsplit("\n", 1)[0]))
    assert shared >= 80 and len(set(prompts)) == 6
    prefixed = [s.turns[0].text for s in REQUEST_WORKLOADS["multi-prefix"](tokenizer, cfg)]
    assert len({p.split("\nQuestion")[0] for p in prefixed}) > 1 and len(set(prefixed)) == 6
    chats = REQUEST_WORKLOADS["multi-turn"](tokenizer, cfg)
    assert len(chats) == 6 and all(s.chat and len(s.turns) == 3 for s in chats)
    tags = [s.tag for s in REQUEST_WORKLOADS["long-prompt"](tokenizer, cfg)]
    assert tags.count("long") == 2 and tags.count("short") == 6 and tags[0] == "short"
    lengths = {
        s.turns[0].params["max_new_tokens"] for s in REQUEST_WORKLOADS["random"](tokenizer, cfg)
    }
    assert len(lengths) > 1 and all(4 <= n <= 64 for n in lengths)
    assert all(s.turns[0].params["json_schema"] for s in REQUEST_WORKLOADS["json"](tokenizer, cfg))


def test_static_mode_admits_a_batch_only_when_the_last_one_ended(tiny_model_dir):
    from radixrt.sampling_params import SamplingParams

    outputs = {}
    for mode in ("continuous", "static"):
        scheduler = make_scheduler(
            tiny_model_dir, attention_backend="auto", max_total_tokens=2048, schedule_mode=mode
        )
        params = [
            SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (2, 12, 4)
        ]
        reqs = [scheduler.make_request(str(i), [5 + i, 6, 7, 8], p) for i, p in enumerate(params)]
        for req in reqs[:2]:
            scheduler.add_request(req)
        while not reqs[0].finished:
            scheduler.step()
        scheduler.add_request(reqs[2])
        scheduler.step()
        assert (reqs[2] in scheduler.running) == (mode == "continuous")
        while scheduler.has_work():
            scheduler.step()
            if mode == "static" and reqs[2].output_ids:
                assert reqs[1].finished
        outputs[mode] = [r.output_ids for r in reqs]
    assert outputs["static"] == outputs["continuous"]


TINY = [
    "--num-requests",
    "3",
    "--max-new-tokens",
    "4",
    "--prefix-tokens",
    "24",
    "--question-tokens",
    "4",
]


def test_every_workload_runs_at_tiny_size(tiny_model_dir, tmp_path, capsys):
    main(
        [
            "bench",
            "--workload",
            "all",
            "--systems",
            "radixrt",
            "--model",
            str(tiny_model_dir),
            *TINY,
            "--turns",
            "2",
            "--long-prompts",
            "1",
            "--long-tokens",
            "120",
            "--max-total-tokens",
            "4096",
            "--output-dir",
            str(tmp_path),
        ]
    )
    for workload in (
        "shared-prefix",
        "multi-prefix",
        "multi-turn",
        "long-prompt",
        "random",
        "json",
        "agent",
        "few-shot-select",
        "tree-of-thought",
    ):
        payload = json.loads((tmp_path / f"{workload}.json").read_text())
        assert payload["setup"]["cores"] and payload["setup"]["versions"]["torch"]
        assert payload["results"] and all(
            r["summary"]["errors"] == 0 for r in payload["results"]
        ), workload
    assert "constraint masks" in capsys.readouterr().out
    for plot in ("long-prompt-itl.png", "cache-hit-rate.png"):
        assert (tmp_path / plot).stat().st_size > 1000


def test_multi_prefix_over_a_fleet(tiny_model_dir, tmp_path, capsys):
    """The data-parallel variants run as fleets (router and two workers) and share the pool."""
    main(
        ["bench", "--workload", "multi-prefix", "--systems", "radixrt-dp2,radixrt-dp2-round-robin"]
        + ["--model", str(tiny_model_dir), *TINY, "--max-total-tokens", "4096"]
        + ["--output-dir", str(tmp_path)]
    )
    payload = json.loads((tmp_path / "multi-prefix.json").read_text())
    assert [r["system"] for r in payload["results"]] == ["radixrt-dp2", "radixrt-dp2-round-robin"]
    assert all(r["summary"]["errors"] == 0 for r in payload["results"])
    assert "over radixrt-dp2-round-robin" in capsys.readouterr().out


def test_shared_prefix_against_baselines_and_peers(tiny_model_dir, tmp_path, capsys):
    main(["bench", "--model", str(tiny_model_dir), *TINY, "--output-dir", str(tmp_path)])
    results = json.loads((tmp_path / "shared-prefix.json").read_text())["results"]
    assert [r["system"] for r in results][:5] == [
        "radixrt",
        "radixrt-no-cache",
        "radixrt-static",
        "radixrt-int8",
        "transformers",
    ]
    assert results[0]["cache_hit_rate"] > 0.5 and results[1]["cache_hit_rate"] == 0
    # shared pages held once
    assert 0 < results[0]["peak_used_tokens"] < results[1]["peak_used_tokens"]
    assert all(r["summary"]["output_tokens"] > 0 for r in results)
    # floors from the machine's measured rates: reached shares are positive and below the limit
    for r in results[:4]:
        floors = r["floors"]
        assert 0 < floors["compute_s"] and 0 < floors["bandwidth_s"]
        assert 0 < floors["compute_share"] < 1.5 and 0 < floors["bandwidth_share"] < 1.5
    assert results[4]["floors"] is None  # transformers runs in the bench's process: no counters
    out = capsys.readouterr().out
    assert "machine: float32 GEMM" in out and "floors: compute" in out
    # each llama.cpp peer run or skipped
    assert "llama.cpp" in out and "llama-server" in out
    assert "ratio: output throughput over transformers" in out


def test_rate_sweep_plots_throughput_and_ttft(tiny_model_dir, tmp_path, capsys):
    main(
        [
            "bench",
            "--workload",
            "random",
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "4",
            "--max-new-tokens",
            "4",
            "--systems",
            "radixrt,radixrt-static",
            "--sweep-rate",
            "20,80",
            "--output-dir",
            str(tmp_path),
        ]
    )
    results = json.loads((tmp_path / "random-sweep.json").read_text())["results"]
    assert [(r["system"], r["request_rate"]) for r in results] == [
        ("radixrt", 20),
        ("radixrt", 80),
        ("radixrt-static", 20),
        ("radixrt-static", 80),
    ]
    assert (tmp_path / "random-sweep.png").stat().st_size > 1000
    assert "median TTFT" in capsys.readouterr().out


def test_floors_follow_the_counters():
    rates = MachineRates(gemm_flops=1e11, read_bandwidth=2e10)
    weights = {
        "layer_params": 100_000_000,
        "head_params": 28_000_000,
        "weight_bytes": 512_000_000,
        "attention_flops_per_pair": 69_120,
    }
    counters = {"forward_tokens": 1000, "logit_rows": 100, "forward_steps": 40}
    counters["attention_pairs"] = 1_000_000
    floors = Floors.of(rates, weights, counters, duration=4.0)
    # 2 * (1e8 * 1000 + 2.8e7 * 100) + 69120 * 1e6 FLOPs at 1e11/s; 40 reads of 512 MB at 20 GB/s
    assert floors.compute_s == pytest.approx(2.056 + 0.6912)
    assert floors.bandwidth_s == pytest.approx(1.024)
    assert floors.compute_share == pytest.approx((2.056 + 0.6912) / 4)
    assert floors.bandwidth_share == pytest.approx(0.256)


def test_agent_tools_over_http_at_tiny_size(tiny_model_dir, tmp_path, capsys):
    """The random tiny model still calls validly whenever a call is constrained (a named call
    to get_weather, whose strings are bounded, always fits in 96 tokens)."""
    main(
        [
            "bench",
            "--backend",
            "http",
            "--workload",
            "agent-tools",
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "2",
            "--turns",
            "1",
            "--max-new-tokens",
            "96",
            "--max-total-tokens",
            "4096",
            "--output-dir",
            str(tmp_path),
        ]
    )
    payload = json.loads((tmp_path / "agent-tools.json").read_text())
    modes = {m["mode"]: m for m in payload["modes"]}
    assert set(modes) == {"required", "named", "auto", "unconstrained"}
    assert modes["named"]["turns_that_called"] == 1.0 and modes["named"]["parse_valid"] == 1.0
    assert modes["required"]["parse_valid"] in (None, 1.0)
    assert modes["auto"]["parse_valid"] in (None, 1.0)
    assert set(payload["turn_time_over_unconstrained"]) == {"required", "named", "auto"}
    assert "parse+valid" in capsys.readouterr().out


def test_the_kernel_suite_measures_the_1b_layer_and_the_read_bandwidth():
    """`--workload kernels`' linears are TinyLlama-1.1B's as served (q/k/v and gate/up fused),
    and the read bandwidth it reports GEMV against comes from a real pass over memory."""
    from radixrt.bench.suites.kernels import layer_shapes, read_bandwidth
    from radixrt.kernels import native

    assert layer_shapes() == [
        ("qkv", 2048 + 2 * 4 * 64, 2048),
        ("o", 2048, 2048),
        ("gate_up", 2 * 5632, 2048),
        ("down", 2048, 5632),
    ]
    if native.find_compiler() is None:
        pytest.skip("needs a C compiler")
    assert 1e8 < read_bandwidth() < 1e13


# test-backend-ops' and llama-bench's own output (this llama.cpp's, 2026-12-05), trimmed
TEST_BACKEND_OPS_SQL = """\
Testing 1 devices

CREATE TABLE IF NOT EXISTS test_backend_ops (
  test_time TEXT,
  build_commit TEXT,
  backend_name TEXT,
  op_name TEXT,
  op_params TEXT,
  test_mode TEXT,
  supported INTEGER,
  passed INTEGER,
  error_message TEXT,
  time_us REAL,
  flops REAL,
  bandwidth_gb_s REAL,
  memory_kb INTEGER,
  n_runs INTEGER,
  device_description TEXT,
  backend_reg_name TEXT
);

INSERT INTO test_backend_ops (test_time, build_commit, backend_name, op_name, op_params, \
test_mode, supported, passed, error_message, time_us, flops, bandwidth_gb_s, memory_kb, n_runs, \
device_description, backend_reg_name) VALUES ('2026-12-05T05:34:58Z', '0c1e570-dirty', 'CPU', \
'MUL_MAT', 'type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,\
src_overlap=0,m_v=0,pad=0', 'perf', '1', '1', '', '3032.773913', '38723793915.170212', \
'0.000000', '32328', '345', '', '');
INSERT INTO test_backend_ops (test_time, build_commit, backend_name, op_name, op_params, \
test_mode, supported, passed, error_message, time_us, flops, bandwidth_gb_s, memory_kb, n_runs, \
device_description, backend_reg_name) VALUES ('2026-12-05T05:34:59Z', '0c1e570-dirty', 'CPU', \
'MUL_MAT', 'type_a=q8_0,type_b=f32,m=4096,n=512,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,\
o=1,src_overlap=0,m_v=0,pad=0', 'perf', '0', '0', '', '0', '0', '0', '0', '0', '', '');
"""
LLAMA_BENCH_JSON = (
    '[{"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 32, "n_gen": 0,'
    ' "avg_ts": 81.635629, "stddev_ts": 0.0},'
    ' {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 0, "n_gen": 8,'
    ' "avg_ts": 55.546964, "stddev_ts": 0.5}]'
)


def test_llama_cpps_own_benchmarks_are_read_from_their_output():
    """test-backend-ops' SQL records (its CSV leaves the figures out) give GOP/s for the
    supported cases only, by GGUF type and rows; llama-bench's JSON gives pp/tg rows."""
    from radixrt.bench import ggml_bench

    assert ggml_bench.parse_mul_mat(TEST_BACKEND_OPS_SQL) == [
        ggml_bench.GgmlMulMat("Q4_0", 1, 38.723793915170212)
    ]
    assert ggml_bench.parse_llama_bench(LLAMA_BENCH_JSON) == [
        ggml_bench.LlamaBenchRow("pp32", 81.635629, 0.0),
        ggml_bench.LlamaBenchRow("tg8", 55.546964, 0.5),
    ]
    assert ggml_bench.perf_threads(2) == 1 and ggml_bench.perf_threads(1) == 1


def test_the_3b_shape_is_llama_3_2_3bs_layers():
    """`--model-shape llama-3.2-3b`: Llama-3.2-3B's layers with the default model's vocabulary
    (2.9B parameters), tied, written in bfloat16 (its float32 state would not fit here)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixrt.bench.shapes import BFLOAT16_SHAPES, SHAPES

    config = LlamaConfig(**SHAPES["llama-3.2-3b"], vocab_size=49152)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert 2.8e9 < params < 3.0e9 and "llama-3.2-3b" in BFLOAT16_SHAPES


def test_a_timed_decode_step_keeps_the_batch_whole(tiny_model_dir):
    """`radixrt.bench.decode_step`: the batch decodes whole (admitted, one token to compute)
    before and through every timed step; released, the scheduler is empty again."""
    from radixrt.bench.decode_step import private_prompts, release, start_decoding, time_steps

    scheduler = make_scheduler(tiny_model_dir, max_total_tokens=1024)
    prompts = private_prompts(3, 20)
    assert prompts == private_prompts(3, 20) and len({tuple(p) for p in prompts}) == 3
    reqs = start_decoding(scheduler, prompts, steps=4)
    assert {id(r) for r in scheduler.running} == {id(r) for r in reqs}
    assert all(r.tokens_to_compute == 1 for r in reqs)
    step = time_steps(scheduler, reqs, 4)
    assert 0 < step.wall_s and 0 <= step.cpu_s
    release(scheduler, reqs)
    assert not scheduler.has_work()


def test_step_suites_at_tiny_size(tiny_model_dir, tmp_path, capsys):
    """decode-step (in place against gathered) and quant-step (three weight formats), one
    small batch each, into their JSON files."""
    small = ["--model", str(tiny_model_dir), "--steps", "2", "--repeats", "1"]
    small += ["--output-dir", str(tmp_path)]
    main(["bench", "--workload", "decode-step", "--batches", "2", "--contexts", "32", *small])
    main(["bench", "--workload", "quant-step", "--batches", "2", *small])
    (decode,) = json.loads((tmp_path / "decode-step.json").read_text())["results"]
    assert (decode["batch"], decode["context"]) == (2, 32) and decode["speedup"] > 0
    quant = json.loads((tmp_path / "quant-step.json").read_text())
    assert [r["quantization"] for r in quant["results"]] == ["float32", "int8", "int4"]
    assert set(quant["speed_ratios"]["2"]) == {"int4/int8", "int4/float32", "int8/float32"}
    out = capsys.readouterr().out
    assert "gathered" in out and "batch 2: float32" in out


def test_kv_cache_dtype_at_tiny_size(tiny_model_dir, tmp_path):
    """A one-byte pool holds more tokens in the budget; each format's forward is timed."""
    main(
        ["bench", "--workload", "kv-cache-dtype", "--model", str(tiny_model_dir)]
        + ["--batches", "1", "--contexts", "16", "--steps", "1", "--output-dir", str(tmp_path)]
    )
    results = json.loads((tmp_path / "kv-cache-dtype.json").read_text())["results"]
    kv = {r["kv_cache_dtype"]: r for r in results}
    assert list(kv) == ["auto", "int8", "fp8_e4m3"]
    assert kv["int8"]["tokens_in_budget"] > kv["auto"]["tokens_in_budget"]
    assert all(len(r["forwards"]) == 1 and r["forwards"][0]["best_s"] > 0 for r in results)


def test_logprob_drift_at_tiny_size(tiny_model_dir, tmp_path):
    """Every condition compared with its reference, within int8 as well."""
    main(
        ["bench", "--workload", "logprob-drift", "--model", str(tiny_model_dir)]
        + ["--num-requests", "2", "--max-new-tokens", "3", "--output-dir", str(tmp_path)]
    )
    drift = json.loads((tmp_path / "logprob-drift.json").read_text())
    assert [d["condition"] for d in drift["results"]] == [
        "batched",
        "cached",
        "chunked",
        "int8 batched",
        "int8 cached",
    ]
    assert drift["prompts"] == 2 and drift["new_tokens"] == 3
