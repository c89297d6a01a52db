"""The drafting side of speculative decoding, without a model: n-gram lookups, the corpus's
bound, the adaptive draft length, and the rejection rule that keeps sampling exact."""

from __future__ import annotations

import torch

from radixrt.engine.sampler import _draw
from radixrt.speculative import DraftLength, NgramCorpus, NgramDrafter, NgramIndex
from radixrt.speculative.draft_length import MAX_PAUSE_STEPS


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
    assert all(seq_id in corpus.sequences for seq_id, _ in corpus.latest.values())


def test_drafter_prefers_the_source_that_matches_further_back():
    drafter = NgramDrafter(num_draft_tokens=4)
    drafter.remember([5, 6, 7, 1, 2, 40, 41, 42])  # "1 2" then 40...
    state = drafter.new_request()
    own = [7, 8, 1, 2, 30, 31, 32, 9, 7, 8, 1, 2]  # "7 8 1 2" then 30... in the request itself
    assert drafter.propose(state, own, limit=8) == [30, 31, 32, 9]
    other = drafter.new_request()
    assert drafter.propose(other, [3, 1, 2], limit=8) == [40, 41, 42]  # only the corpus has it
    assert drafter.propose(other, [3, 1, 2], limit=2) == [40, 41]
    assert drafter.propose(other, [3, 1, 2], limit=0) == []


def test_draft_length_grows_on_acceptance_and_pauses_on_rejection():
    length = DraftLength(limit=8, current=2)
    length.update(offered=2, accepted=2)
    assert length.next() == 4
    length.update(offered=4, accepted=1)
    assert length.next() == 2
    pauses = []
    for _ in range(8):  # wholly rejected again and again: ever longer pauses, bounded
        length.update(offered=1, accepted=0)
        pauses.append(length.pause)
        while length.next() == 0:
            pass
    assert pauses == sorted(pauses) and pauses[-1] == MAX_PAUSE_STEPS
    assert length.current == 1


def test_rejection_rule_keeps_the_distribution():
    """A proposal certain of its token, accepted with p(draft), else a draw from p without it:
    the output frequencies follow p (unnormalized p, as top-k leaves it, too)."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0]) * 0.7
    generator = torch.Generator().manual_seed(0)
    for draft in (0, 2, 3):
        counts = torch.zeros(4)
        for _ in range(6000):
            counts[_draw(probs, draft, generator)] += 1
        assert torch.allclose(counts / counts.sum(), probs / probs.sum(), atol=0.025), (
            draft,
            counts,
        )
