"""What of the CUDA-graph runner a CPU can check: which batch sizes are captured, and that the
CPU path never builds graphs. Capture and replay themselves run in `make gpu-check`."""

from __future__ import annotations

import pytest

from radixrt.config import ServerArgs
from radixrt.executor.cuda_graph_runner import CAPTURE_SIZES, capture_sizes
from radixrt.executor.model_runner import ModelRunner


@pytest.mark.parametrize("limit", [1, 3, 16, 17, 64, 1000])
def test_capture_sizes_cover_every_batch_up_to_the_running_limit(limit):
    sizes = capture_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(limit, CAPTURE_SIZES[-1])
    assert all(s <= limit for s in sizes)


def test_the_cpu_runs_without_graphs(tiny_model_dir):
    runner = ModelRunner(ServerArgs(model=str(tiny_model_dir), max_total_tokens=64).executor)
    assert runner.graph_runner is None
