"""Speculative decoding without a draft model: n-gram drafts from what the server has seen and
from the request's own tokens (`ngram.py`), as many as their acceptance rate says are worth the
rows they add to a step (`draft_length.py`).
Pure token bookkeeping: no torch, no model; the scheduler verifies the drafts."""

from radixrt.speculative.draft_length import DraftLength, StepCost
from radixrt.speculative.ngram import NgramCorpus, NgramDrafter, NgramIndex, RequestDrafts

__all__ = [
    "DraftLength",
    "NgramCorpus",
    "NgramDrafter",
    "NgramIndex",
    "RequestDrafts",
    "StepCost",
]
