"""The drafting side of speculative decoding, without a model: n-gram lookups, the corpus's
bound and the adaptive draft length."""

from __future__ import annotations

import pytest

from radixrt.speculative import DraftLength, NgramCorpus, NgramDrafter, NgramIndex, StepCost
from radixrt.speculative.draft_length import PRIOR_ROW_SHARE, PRIOR_VERIFY_SHARE, PROBE_STEPS


def test_index_finds_the_latest_earlier_occurrence_not_the_suffix_itself():
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.lookup(tokens) == 6  # "1 2 3" ended at 6, then 7 followed
    tokens += [7, 5, 1, 2]  # the list grows; the index catches up incrementally
    assert index.lookup(tokens) == 10  # the longest n-gram first: "7 5 1 2" ended at 10
    tokens += [8, 8]
    assert index.lookup(tokens) is None


def test_corpus_continues_a_finished_sequence_and_forgets_the_oldest():
    corpus = NgramCorpus(max_tokens=12)
    corpus.add([10, 11, 12, 13, 14, 15])
    seq, end = corpus.lookup([99, 11, 12])
    assert seq[end + 1 :].tolist() == [13, 14, 15]
    corpus.add([20, 21, 22, 23, 24, 25, 26])  # 13 tokens > 12: the first sequence goes
    assert corpus.lookup([11, 12]) is None
    assert corpus.total_tokens == 7 and len(corpus.sequences) == 1
    assert all(hit >> 32 in corpus.sequences for hit in corpus.latest.values())


def test_drafter_prefers_the_source_that_matches_further_back():
    drafter = NgramDrafter(num_draft_tokens=4)
    drafter.remember([5, 6, 7, 1, 2, 40, 41, 42])  # "1 2" then 40...
    state = drafter.new_request()
    own = [7, 8, 1, 2, 30, 31, 32, 9, 7, 8, 1, 2]  # "7 8 1 2" then 30... in the request itself
    free = (0.0, 0.0)
    assert drafter.propose(state, own, limit=8, prices=free) == [30, 31, 32, 9]
    other = drafter.new_request()
    assert drafter.propose(other, [3, 1, 2], 8, free) == [40, 41, 42]  # only the corpus has it
    assert drafter.propose(other, [3, 1, 2], 2, free) == [40, 41]
    assert drafter.propose(other, [3, 1, 2], 0, free) == []
    assert drafter.propose(other, [3, 1, 2], 8, (9.0, 9.0)) == []  # not worth a row


def test_a_long_matched_context_drafts_even_at_a_low_rate():
    drafter = NgramDrafter(num_draft_tokens=8)
    seen = list(range(100, 140))
    drafter.remember(seen + [7, 8, 9])
    state = drafter.new_request()
    state.length.rate = 0.01  # nothing accepted lately
    assert drafter.propose(state, seen[-5:], 8, (0.5, 0.1)) == []  # 5 tokens matched: too few
    assert drafter.propose(state, seen, 8, (0.5, 0.1)) == [7, 8, 9]  # the same 32+ tokens seen


def test_draft_length_follows_the_acceptance_rate_and_the_prices():
    length = DraftLength(limit=8)
    for _ in range(10):  # everything accepted: the rate nears 1, every token is worth drafting
        length.update(offered=4, accepted=4)
    assert length.next(0.5, 0.5) == 8
    for _ in range(10):  # nothing accepted: not even one token pays
        length.update(offered=2, accepted=0)
    assert length.rate < 0.05
    drafted = [length.next(0.1, 0.02) for _ in range(3 * PROBE_STEPS)]
    assert drafted.count(1) == 3 and set(drafted) == {0, 1}  # only the probes
    length.rate = 0.5  # expected gains 0.5, 0.75, 0.875, ...: drafted while they beat the cost
    assert length.next(0.6, 0.3) == 0  # no length brings more than it costs
    assert length.next(0.4, 0.2) == 2  # 0.75 - 0.4 - 0.2 beats 0.5 - 0.4 and 0.875 - 0.4 - 0.4
    assert length.next(0.1, 0.0) == 8


def test_new_requests_start_from_the_servers_acceptance_rate():
    drafter = NgramDrafter(num_draft_tokens=8)
    first = drafter.new_request()
    for _ in range(200):
        drafter.observe(first, offered=2, accepted=0)
    assert drafter.new_request().length.rate < 0.01
    for _ in range(200):
        drafter.observe(first, offered=2, accepted=2)
    assert drafter.new_request().length.rate > 0.99


def test_step_cost_prices_drafts_by_the_batch_they_join():
    cost = StepCost()
    first, further = cost.prices(rows=1, tokens=1)  # before any step: the priors
    assert further == pytest.approx(PRIOR_ROW_SHARE / (1 + PRIOR_ROW_SHARE))
    assert first == pytest.approx((PRIOR_ROW_SHARE + PRIOR_VERIFY_SHARE) / (1 + PRIOR_ROW_SHARE))
    # 40 ms a step, 2.5 ms a row, 4 ms a verifying request
    for rows, verifying in [(1, 0), (2, 1), (5, 1), (9, 1), (8, 0), (16, 4), (24, 8)] * 30:
        cost.observe(rows, verifying, 0.040 + 0.0025 * rows + 0.004 * verifying)
    a, b, c = cost.coefficients()  # the steps outweigh the priors, which still pull a little
    assert (a, b, c) == pytest.approx((0.040, 0.0025, 0.004), rel=0.02)
    first, further = cost.prices(rows=1, tokens=1)  # batch 1: a further row is almost free
    assert (first, further) == pytest.approx((0.0065 / 0.0425, 0.0025 / 0.0425), rel=0.02)
    first, further = cost.prices(rows=8, tokens=8)  # batch 8: a third of a token a row
    assert (first, further) == pytest.approx((0.052 / 0.06, 0.02 / 0.06), rel=0.02)
