"""Stop strings found incrementally (engine/stop_strings.py): the same stop, cut and stream
hold-back as searching the whole window for every stop after every token (the code it replaced,
kept here as the reference), at a cost per character that does not grow with the number or the
length of the stop strings."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.engine.stop_strings import StopAutomaton, StopHit, StopScanner
from radixrt.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS


def reference_feed(text: str, delta: str, stops: list[str]) -> tuple[str, StopHit | None]:
    """The former search: after appending `delta`, each stop in order, from where it could
    first end inside `delta`."""
    text += delta
    for index, stop in enumerate(stops):
        pos = text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
        if pos != -1:
            return text, StopHit(index, pos, pos + len(stop))
    return text, None


def reference_holdback(text: str, stops: list[str]) -> int:
    """The former hold-back: the longest end of the text that is a proper prefix of a stop."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _run_both(stops: list[str], deltas: list[str]) -> None:
    scanner, text = StopScanner(StopAutomaton(stops)), ""
    for delta in deltas:
        text, expected = reference_feed(text, delta, stops)
        assert scanner.feed(delta) == expected, (stops, deltas)
        if expected is not None:
            return
        assert scanner.holdback == reference_holdback(text, stops), (stops, text)


ALPHABET = "abc\n"  # few letters: stops match, overlap and nest often
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6)
DELTAS = st.lists(st.text(ALPHABET, max_size=5), max_size=40)


@settings(max_examples=2000, deadline=None)
@given(STOPS, DELTAS)
def test_equal_to_the_full_search_on_random_cases(stops, deltas):
    _run_both(stops, deltas)


def test_a_stop_spanning_deltas_is_cut_where_it_starts():
    scanner = StopScanner(StopAutomaton(["</end>", "xyz"]))
    assert scanner.feed("hello </") is None
    assert scanner.holdback == 2  # "</" may begin "</end>": a stream holds it back
    assert scanner.feed("en") is None and scanner.holdback == 4
    assert scanner.feed("d> tail") == StopHit(0, 6, 12)


def test_the_first_stop_in_the_requests_order_wins_within_one_delta():
    """Two stops ending in one delta: the earlier in `stop` wins even where it starts later,
    as before (the order is the request's, not the text's)."""
    assert StopScanner(StopAutomaton(["b", "a"])).feed("xab") == StopHit(0, 2, 3)
    assert StopScanner(StopAutomaton(["a", "b"])).feed("xab") == StopHit(0, 1, 2)
    # a stop inside a longer one's prefix, and a repeated stop
    assert StopScanner(StopAutomaton(["abcd", "bc", "bc"])).feed("abc") == StopHit(1, 1, 3)


def test_unicode_and_unmatched_text():
    scanner = StopScanner(StopAutomaton(["ünï", "😀x"]))
    assert scanner.feed("😀ü") is None and scanner.holdback == 1
    assert scanner.feed("n") is None and scanner.holdback == 2
    assert scanner.feed("ï") == StopHit(0, 1, 4)


def _work_per_char(stops: list[str], text: str) -> float:
    scanner = StopScanner(StopAutomaton(stops))
    for i in range(0, len(text), 3):  # about a token's worth at a time
        assert scanner.feed(text[i : i + 3]) is None
    return scanner.work / len(text)


def test_work_per_character_does_not_grow_with_the_number_or_length_of_stops():
    """The issue's shape (32 stops of 1,024 characters, each almost matching all the time) costs
    what one one-character stop does: at most two edges per character, counted by the scanner.
    The old search compared every stop's every prefix against the text's end after every token:
    about 32 x 1,024 x 1,024 / 2 characters per token."""
    rng = random.Random(0)
    text = "a" * 5000 + "".join(rng.choice("ab") for _ in range(5000))
    heavy = ["a" * (MAX_STOP_CHARS - 1) + "c"] + [
        "".join(rng.choice("ab") for _ in range(MAX_STOP_CHARS - 1)) + "c"
        for _ in range(MAX_STOP_STRINGS - 1)
    ]
    light = ["c"]
    assert _work_per_char(light, text) <= 2
    assert _work_per_char(heavy, text) <= 2


def test_holding_back_costs_no_search():
    """The hold-back is read from the state: after a long almost-match it is the match's length,
    with no work beyond feeding the text."""
    scanner = StopScanner(StopAutomaton(["a" * 1000 + "b"]))
    scanner.feed("a" * 999)
    work = scanner.work
    assert scanner.holdback == 999 and scanner.work == work
