"""`host_memory.loading`: under it a freed temporary of a weight's size goes back to the OS
even after glibc's dynamic mmap threshold has risen past that size (the case that kept a 1.1B
load's temporaries resident). Run in a fresh interpreter: the heap's settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixrt.executor import host_memory

CHILD = """
import json, sys, torch
from radixrt.executor import host_memory

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) >> 10

def temporary_left_resident():
    # the first 16 MB chunk is mapped and, freed, raises the dynamic threshold above it: the
    # second comes from the heap, and a small allocation after it pins the heap's top
    first = torch.ones(4 << 20); del first
    before = rss()
    second = torch.ones(4 << 20)
    keep = torch.ones(64)
    del second
    return rss() - before, keep

if sys.argv[1] == "loading":
    with host_memory.loading():
        grown, keep = temporary_left_resident()
else:
    grown, keep = temporary_left_resident()
print(json.dumps(grown))
"""


def _grown(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's heap only")
def test_a_freed_temporary_returns_to_the_os_during_a_load():
    assert _grown("plain") >= 12  # MB: what the load used to keep
    assert _grown("loading") <= 2
