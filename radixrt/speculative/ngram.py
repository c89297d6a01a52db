"""N-gram drafts: the tokens that followed a request's last few tokens elsewhere.

Two sources, both indexed by n-gram (n in NGRAM_SIZES) at their latest occurrence:
- the corpus: the token sequences (prompt and output) of the requests the server finished, the
  same sequences it caches in the radix tree, bounded by a token count with the oldest dropped
  first. It holds what other requests went on to say after the same words: a repeated prompt, a
  JSON key, a tool name.
- the request's own prompt and output (prompt lookup): edits copying their input, agent loops
  echoing earlier calls.
The source whose occurrence matches more tokens back before the n-gram wins (the corpus on a tie).
N-grams are keyed by their hash (a collision only proposes a draft verification rejects), which
keeps an index under 400 bytes a token: under 1% of a token's K/V in the default model.
Why not walk the KV radix tree itself: it is keyed by whole prefixes, so finding where a suffix
occurs means an index anyway, and the tree's splits and evictions would move the positions it
points at. The corpus is fed by the same sequences at the same moment and outlives eviction.
The corpus is the shared cache's companion: only requests without a cache salt or tenant feed
it and draft from it (a salted request drafts from its own tokens only), so one tenant's text
is never proposed to another, nor its acceptance timed.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

from radixrt.speculative.draft_length import SERVER_RATE_WEIGHT, DraftLength, StepCost

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match is likelier to go on the same way
MAX_BACK_MATCH = 32  # how far back a match's length is counted to rank two sources
# a draft whose context matched MAX_BACK_MATCH tokens back (a repeated prompt, a loop) is
# expected to be accepted at least this often, whatever the request's rate says so far
SEEN_CONTEXT_RATE = 0.9
DEFAULT_CORPUS_TOKENS = 1 << 17  # about 50 MB with its index


def _ngrams(tokens: Sequence[int], end: int) -> Iterator[int]:
    """The hashes of the n-grams ending at position `end` (inclusive), longest first."""
    for n in NGRAM_SIZES:
        if end + 1 >= n:
            yield hash(tuple(tokens[end + 1 - n : end + 1]))


def _back_match(a: Sequence[int], a_end: int, b: Sequence[int]) -> int:
    """How many tokens, up to MAX_BACK_MATCH, end `a` at position `a_end` and end `b`."""
    n = 0
    while n < MAX_BACK_MATCH and n <= a_end and n < len(b) and a[a_end - n] == b[-1 - n]:
        n += 1
    return n


class NgramIndex:
    """The latest end position of every n-gram of one growing token list. It indexes up to the
    second-to-last token, so looking up the list's own last tokens finds an earlier occurrence."""

    def __init__(self) -> None:
        self.latest: dict[int, int] = {}  # n-gram hash -> end position
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def lookup(self, tokens: Sequence[int]) -> int | None:
        """End position of the latest earlier occurrence of the longest n-gram `tokens` ends
        with, or None."""
        for end in range(self.indexed, len(tokens) - 1):
            for key in _ngrams(tokens, end):
                self.latest[key] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
        for key in _ngrams(tokens, len(tokens) - 1):
            if key in self.latest:
                return self.latest[key]
        return None


class NgramCorpus:
    """Finished requests' token sequences, at most `max_tokens` of them (oldest dropped first),
    with each n-gram's latest occurrence that has a continuation: sequence id << 32 | end."""

    def __init__(self, max_tokens: int = DEFAULT_CORPUS_TOKENS):
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, array[int]] = OrderedDict()
        self.total_tokens = 0
        self.latest: dict[int, int] = {}
        self._ids = count()

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < 2 or len(tokens) > self.max_tokens:
            return
        seq_id = next(self._ids)
        self.sequences[seq_id] = array("l", tokens)
        self.total_tokens += len(tokens)
        for end in range(len(tokens) - 1):
            for key in _ngrams(tokens, end):
                self.latest[key] = seq_id << 32 | end
        while self.total_tokens > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        seq_id, tokens = self.sequences.popitem(last=False)
        self.total_tokens -= len(tokens)
        for end in range(len(tokens) - 1):
            for key in _ngrams(tokens, end):
                if self.latest.get(key, -1) >> 32 == seq_id:
                    del self.latest[key]

    def lookup(self, tokens: Sequence[int]) -> tuple[array[int], int] | None:
        """(sequence, end position) of the latest occurrence of the longest n-gram `tokens`
        ends with, or None."""
        for key in _ngrams(tokens, len(tokens) - 1):
            hit = self.latest.get(key)
            if hit is not None:
                return self.sequences[hit >> 32], hit & 0xFFFFFFFF
        return None


@dataclass
class RequestDrafts:
    """One request's drafting state: its own n-gram index and its adaptive draft length."""

    length: DraftLength
    index: NgramIndex = field(default_factory=NgramIndex)
    accepted: int = 0  # drafted tokens the model agreed with
    shared: bool = True  # drafts from the server-wide corpus too (a request without a salt)


class NgramDrafter:
    """Proposes drafts for decoding requests and learns from finished ones (server-wide)."""

    def __init__(self, num_draft_tokens: int, corpus_tokens: int = DEFAULT_CORPUS_TOKENS):
        self.num_draft_tokens = num_draft_tokens
        self.corpus = NgramCorpus(corpus_tokens)
        self.cost = StepCost()  # what a drafted token's row costs, fitted from the steps
        # the acceptance rate over every request's verifications, slowly: a new request's prior,
        # so short requests of a workload that copies little do not each pay to find it out
        self.server_rate = DraftLength(num_draft_tokens)

    def new_request(self, shared: bool = True) -> RequestDrafts:
        """A request's drafting state; `shared`: it may draft from the corpus (no salt)."""
        return RequestDrafts(
            DraftLength(self.num_draft_tokens, rate=self.server_rate.rate), shared=shared
        )

    def propose(
        self, state: RequestDrafts, tokens: Sequence[int], limit: int, prices: tuple[float, float]
    ) -> list[int]:
        """Up to `limit` tokens likely to follow `tokens`, as many as are worth their `prices`
        (the first drafted token's and each further one's; see `DraftLength.next`)."""
        if limit <= 0:
            return []
        matched, draft = 0, []
        hit = self.corpus.lookup(tokens) if state.shared else None
        if hit is not None:
            seq, end = hit
            matched, draft = _back_match(seq, end, tokens), seq[end + 1 : end + 1 + limit].tolist()
        own_end = state.index.lookup(tokens)
        if own_end is not None:
            own = _back_match(tokens, own_end, tokens)
            if own > matched:
                matched, draft = own, list(tokens[own_end + 1 : own_end + 1 + limit])
        if not draft:
            return []
        rate = state.length.rate
        if matched >= MAX_BACK_MATCH:
            rate = max(rate, SEEN_CONTEXT_RATE)
        return draft[: state.length.next(*prices, rate=rate)]

    def observe(self, state: RequestDrafts, offered: int, accepted: int) -> None:
        """After verifying a draft: adapt the request's draft length."""
        state.accepted += accepted
        state.length.update(offered, accepted)
        self.server_rate.update(offered, accepted, SERVER_RATE_WEIGHT)

    def remember(self, tokens: Sequence[int]) -> None:
        """A finished request's prompt and output, for later requests' drafts."""
        self.corpus.add(tokens)
