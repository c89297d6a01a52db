"""Stop strings found incrementally: one Aho–Corasick automaton over a request's stop strings,
fed each new piece of text once.

A token then costs work in proportion to the text it adds (amortized: each character moves the
automaton one edge forward and at most as many failure edges back as it went forward), however
many stop strings a request has and however long they are. The state after the text also says
how much of the text's end could still become a stop string, which streaming holds back.

The automaton is built once per request (its `n` samples share it) and its size is bounded by
the stop strings' total length (`sampling_params.MAX_STOP_STRINGS` x `MAX_STOP_CHARS`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import regex

NO_STOP = 1 << 30  # `first` of a state where no stop string ends
_CHARS = 0x110000  # code points: an edge's key is state * _CHARS + ord(char)
# what one search of a request's text for its stop regexes may take: a pattern that backtracks
# catastrophically ends its own request (`StopRegexTimeout`), not the batch's progress
STOP_REGEX_TIMEOUT_S = 0.05


@dataclass(frozen=True)
class StopHit:
    """A stop string (or regex match) found in the text: which one (its index in `stop` or
    `stop_regex`), and where it starts and ends."""

    index: int
    start: int
    end: int


class StopAutomaton:
    """The trie of the stop strings with failure links. State s stands for a prefix of some stop
    string, `depth[s]` characters long; `first[s]` is the smallest index of a stop string that is
    a suffix of that prefix (NO_STOP when none is)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.edges: dict[int, int] = {}
        self.depth = [0]
        self.first = [NO_STOP]
        children: list[list[tuple[int, int]]] = [[]]  # state -> its (code, child) edges
        for index, stop in enumerate(self.stops):
            self._insert(index, stop, children)
        self.fail = [0] * len(self.depth)
        self._link(children)

    def _insert(self, index: int, stop: str, children: list[list[tuple[int, int]]]) -> None:
        state, edges, depth = 0, self.edges, self.depth
        for ch in stop:
            code = ord(ch)
            key = state * _CHARS + code
            nxt = edges.get(key)
            if nxt is None:
                nxt = len(depth)
                edges[key] = nxt
                depth.append(depth[state] + 1)
                children[state].append((code, nxt))
                children.append([])
            state = nxt
        self.first.extend([NO_STOP] * (len(depth) - len(self.first)))
        self.first[state] = min(self.first[state], index)

    def _link(self, children: list[list[tuple[int, int]]]) -> None:
        """Failure links breadth first; each state's `first` takes its failure state's too."""
        edges, fail, first = self.edges, self.fail, self.first
        queue = deque(child for _, child in children[0])
        while queue:
            state = queue.popleft()
            for code, child in children[state]:
                back = fail[state]
                while back and back * _CHARS + code not in edges:
                    back = fail[back]
                fail[child] = edges.get(back * _CHARS + code, 0)
                first[child] = min(first[child], first[fail[child]])
                queue.append(child)


class StopScanner:
    """One request's walk through its automaton over its text so far. `work` counts the edges
    taken (forward and failure), the measure of what stop strings cost."""

    def __init__(self, automaton: StopAutomaton):
        self.automaton = automaton
        self.state = 0
        self.fed = 0  # characters of the text fed so far
        self.work = 0

    def feed(self, delta: str) -> StopHit | None:
        """Feed the text's next piece. Among the stop strings that end inside it, the first in
        the request's order, at its first occurrence (or None)."""
        a, state, work = self.automaton, self.state, 0
        best, best_end = NO_STOP, 0
        for offset, ch in enumerate(delta):
            code = ord(ch)
            while True:
                work += 1
                nxt = a.edges.get(state * _CHARS + code)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = a.fail[state]
            if a.first[state] < best:
                best, best_end = a.first[state], self.fed + offset + 1
        self.state, self.work = state, self.work + work
        self.fed += len(delta)
        if best == NO_STOP:
            return None
        return StopHit(best, best_end - len(a.stops[best]), best_end)

    @property
    def holdback(self) -> int:
        """Characters at the end of the text that could still begin a stop string (while no
        stop string has been found, the longest suffix that is a proper prefix of one)."""
        return self.automaton.depth[self.state]


class StopRegexTimeout(Exception):
    """A stop regex's search took longer than STOP_REGEX_TIMEOUT_S."""


class StopRegexes:
    """A request's `stop_regex` patterns (SGLang's), searched for in its whole text after each
    token, as a match may start anywhere before the newest piece. Python's `re` syntax, matched
    by the `regex` module, whose timeout bounds each search."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self.compiled = [regex.compile(p) for p in self.patterns]

    def search(self, text: str) -> StopHit | None:
        """The match that starts first (the earlier pattern on a tie), or None;
        StopRegexTimeout when a search runs too long."""
        best: StopHit | None = None
        for index, pattern in enumerate(self.compiled):
            try:
                match = pattern.search(text, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise StopRegexTimeout(self.patterns[index]) from None
            if match is not None and (best is None or match.start() < best.start):
                best = StopHit(index, match.start(), match.end())
        return best
