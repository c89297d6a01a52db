"""The soak's 60-second version on the tiny model: `make soak-ci` runs it (CI does, after `make
test`, which leaves it out: a fixed-duration run gains nothing from a faster suite); `make soak`
runs the long one."""

from __future__ import annotations

import dataclasses

import pytest

from radixrt.reliability.soak import KINDS, Soak, SoakConfig

from helpers import QWEN3_5, random_checkpoint

KNOWN_CODES = {
    "rate_limited",
    "timeout",
    "draining",
    "aborted",
    "connection_lost",
    "overloaded",
    "client_timeout",
}


@pytest.mark.soak
def test_soak_60s(tiny_model_dir, tmp_path):
    report = Soak(
        SoakConfig(str(tiny_model_dir), 60, 4, tmp_path, kill_every_s=12, max_total_tokens=2048)
    ).run()
    _check(report, tmp_path)


@pytest.mark.soak
def test_a_hybrid_soak_with_swap_leaks_no_state_slot(tiny_model_dir, tmp_path):
    """The same 60 s on a tiny Qwen3.5 (Gated DeltaNet layers, a state per request) with the
    host tier and swap preemption, in a pool small enough that requests are retracted: state
    slots are owned once at every invariant check, and after the drain every one is free."""
    folder = random_checkpoint(tmp_path / "qwen3_5", tiny_model_dir, "qwen3_5_text", QWEN3_5, 5)
    template = tiny_model_dir / "chat_template.jinja"
    (folder / template.name).write_bytes(template.read_bytes())
    flags = ("--enable-hierarchical-cache", "--preemption-mode", "swap")
    config = SoakConfig(str(folder), 60, 4, tmp_path, kill_every_s=12, max_total_tokens=1024)
    report = Soak(dataclasses.replace(config, server_flags=flags)).run()
    _check(report, tmp_path)
    assert report.leaked_state_slots == 0


def _check(report, tmp_path) -> None:
    print((tmp_path / "soak.md").read_text())
    assert report.server_deaths == 0
    assert report.restart_exit_code == 0 and report.final_exit_code == 0, "a drain did not exit 0"
    assert report.leaked_slots == 0 and report.leaked_rows == 0
    assert report.invariant_checks >= 5 and not report.invariant_failures
    assert report.abort_times_s and max(report.abort_times_s) <= 6.0
    assert report.malformed_sent and report.malformed_answered == report.malformed_sent
    assert set(report.errors) <= KNOWN_CODES, report.errors
    assert set(report.outcomes_by_kind) == set(KINDS)
    assert report.served >= 20  # a floor, not a throughput target: this CPU is shared
    assert (tmp_path / "rss.png").stat().st_size > 0
