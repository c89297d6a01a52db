"""The KV pool's memory follows what it serves: its CPU buffers are anonymous maps backed page by
page at first write, and a flush with nothing running hands the pages back (after a burst of 64
x 256-token replies and a flush, the default model's runtime kept 700 MB before). Measured by the
kernel's own count of each map's resident pages (/proc/self/smaps), on the real pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from helpers import make_scheduler, run_in_process

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").is_file(), reason="resident pages are read from Linux's /proc"
)


def _resident(tensors) -> int:
    """Bytes of these tensors' maps resident now, by /proc/self/smaps (each tensor starts its
    own map)."""
    starts = {t.data_ptr() for t in tensors}
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) in starts
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_a_flush_hands_the_pools_pages_back(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir, max_total_tokens=16384)
    pool = scheduler.runner.kv_pool
    buffers = [*pool.k_buffers, *pool.v_buffers]
    per_token = pool.bytes_per_token
    assert _resident(buffers) < 64 * per_token + (1 << 20)  # nothing written yet
    random.seed(0)
    prompts = [[random.randrange(1000, 40000) for _ in range(1000)] for _ in range(6)]
    run_in_process(scheduler, [prompts], {"max_new_tokens": 4, "temperature": 0})
    assert _resident(buffers) >= 6000 * per_token  # the burst's slots are backed
    assert scheduler.flush_cache()
    assert _resident(buffers) < 64 * per_token + (1 << 20)
    # and the pool serves on: pages written again after the flush
    again = run_in_process(scheduler, [prompts[:1]], {"max_new_tokens": 4, "temperature": 0})
    assert again == run_in_process(
        scheduler, [prompts[:1]], {"max_new_tokens": 4, "temperature": 0}
    )
