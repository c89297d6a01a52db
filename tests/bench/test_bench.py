"""The benchmark's arithmetic on hand-made numbers, and a smoke run of every system at tiny size."""

from __future__ import annotations

import json

from radixrt.bench import percentile, shared_prefix_workload
from radixrt.cli import main


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert abs(percentile(list(map(float, range(101))), 99) - 99.0) < 1e-9


def test_shared_prefix_workload_shares_its_prefix(tiny_model_dir):
    from transformers import AutoTokenizer

    prompts = shared_prefix_workload(AutoTokenizer.from_pretrained(tiny_model_dir), 4, 40, 8, seed=3)
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    assert common >= 40 and len({tuple(p) for p in prompts}) == 4


def test_bench_smoke(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--model", str(tiny_model_dir), "--num-requests", "4", "--prefix-tokens", "24",
          "--question-tokens", "4", "--max-new-tokens", "4", "--max-total-tokens", "1024", "--output", str(out),
          "--systems", "radixrt,radixrt-no-cache,transformers,radixrt-server,radixrt-inprocess"])
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["radixrt", "radixrt-no-cache", "transformers", "radixrt-server",
                                              "radixrt-inprocess"]
    assert all(r["output_tokens"] == 16 and r["output_throughput"] > 0 for r in results)
    assert results[0]["cache_hit_rate"] > 0.5 and results[1]["cache_hit_rate"] == 0
    assert "ratio" in capsys.readouterr().out
