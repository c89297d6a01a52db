"""Admission arithmetic and victim choice, without a model."""

from __future__ import annotations

import pytest

from radixrt.engine.budget import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    AdmissionBudget,
)
from radixrt.engine.schedule_policy import pick_victim


def test_step_tokens_are_bounded_by_the_chunk_when_chunking():
    assert AdmissionBudget(512, 8192).step_tokens() == 512
    assert AdmissionBudget(4096, 1024).step_tokens() == 1024
    assert AdmissionBudget(0, 8192).step_tokens() == 8192
    assert AdmissionBudget(-1, 100).step_tokens() == 100


@pytest.mark.parametrize(
    "chunk, need, left, expected",
    [
        (8, 20, 100, 8),  # a long prompt is cut to the chunk size
        (8, 5, 100, 5),  # a short one runs whole
        (8, 20, 3, 3),  # the step's tokens run out first
        (0, 20, 100, 20),  # without chunking: whole ...
        (0, 20, 19, 0),  # ... or not this step
        (-1, 19, 19, 19),
    ],
)
def test_chunk(chunk, need, left, expected):
    assert AdmissionBudget(chunk, 8192).chunk(need, left) == expected


def test_new_token_ratio_decays_to_a_floor_and_resets():
    budget = AdmissionBudget(2048, 8192)
    assert budget.expected(10, 100) == pytest.approx(10 + 100 * INIT_NEW_TOKEN_RATIO)
    budget.decay()
    assert budget.new_token_ratio == pytest.approx(INIT_NEW_TOKEN_RATIO - NEW_TOKEN_RATIO_DECAY)
    for _ in range(10_000):
        budget.decay()
    assert budget.new_token_ratio == MIN_NEW_TOKEN_RATIO
    assert budget.expected(0, 50) == pytest.approx(50 * MIN_NEW_TOKEN_RATIO)
    budget.reset()
    assert budget.new_token_ratio == INIT_NEW_TOKEN_RATIO


class _Candidate:
    """The three things victim choice reads of a request."""

    def __init__(self, prompt: int, generated: int, priority: int = 0):
        self.input_ids, self.output_ids = [0] * prompt, [0] * generated
        self.priority = priority


def test_victim_loses_least():
    few_long = _Candidate(prompt=50, generated=2)
    few_short = _Candidate(prompt=10, generated=2)
    many = _Candidate(prompt=90, generated=30)
    assert pick_victim([many, few_short, few_long]) is few_long
    assert pick_victim([many, few_short]) is few_short
    urgent = _Candidate(prompt=50, generated=2, priority=3)
    assert pick_victim([urgent, many]) is many, "a lower priority goes first"
    assert pick_victim([many]) is None  # the last request is never retracted
    assert pick_victim([]) is None
