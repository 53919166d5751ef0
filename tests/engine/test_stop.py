from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from morion.engine.stop import StopCheck, StopStringMatcher


def _run(stop: list[str], pieces: list[str]) -> tuple[list[StopCheck], str]:
    matcher = StopStringMatcher(stop)
    checks = []
    for piece in pieces:
        checks.append(matcher.feed(piece))
        if checks[-1].stopped:
            break
    return checks, matcher.flush()


def test_match_inside_one_piece() -> None:
    assert StopStringMatcher(["STOP"]).feed("Hello STOP world") == StopCheck("Hello ", True)


def test_match_at_start_emits_nothing() -> None:
    assert StopStringMatcher(["</s>"]).feed("</s>rest") == StopCheck("", True)


def test_stop_string_spanning_pieces() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("abc</") == StopCheck("abc", False)
    assert matcher.feed("en") == StopCheck("", False)
    assert matcher.feed("d>tail") == StopCheck("", True)
    assert matcher.stopped
    assert matcher.flush() == ""


def test_partial_match_that_is_not_a_stop_is_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == StopCheck("", False)
    # "STARS" cannot start "STOP" except for its last "S", which stays held.
    assert matcher.feed("ARS") == StopCheck("STAR", False)
    assert matcher.feed(" ok") == StopCheck("S ok", False)
    assert matcher.flush() == ""


def test_flush_returns_held_tail() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("answer\n\nUs") == StopCheck("answer", False)
    assert matcher.flush() == "\n\nUs"
    assert matcher.flush() == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    assert StopStringMatcher(["world", "lo w"]).feed("hello world") == StopCheck("hel", True)
    # "bcd" starts before "cd" and began in the held-back tail of the first piece.
    checks, _ = _run(["cd", "bcd"], ["ab", "cde"])
    assert checks == [StopCheck("a", False), StopCheck("", True)]


def test_feed_after_stop_stays_stopped() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == StopCheck("a", True)
    assert matcher.feed("more") == StopCheck("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_everything_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == StopCheck("abc", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@given(
    text=st.text(alphabet="abc", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
)
def test_pieces_match_the_text_so_far_reference(text: str, cuts: list[int], stop: list[str]) -> None:
    """Generation stops at the first piece after which the text so far holds a stop string, and the answer
    ends where the earliest such match starts. A longer stop string that began earlier but has not
    completed by then does not count: a server never generates past a completed stop string to see
    (text "baa" in pieces "ba" + "a" with stops "a" and "baa" ends as "b")."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    checks, tail = _run(stop, pieces)
    expected, stopped = text, False
    for end in bounds[1:]:
        found = [i for i in (text[:end].find(s) for s in stop) if i >= 0]
        if found:
            expected, stopped = text[: min(found)], True
            break
    assert "".join(c.emit for c in checks) + tail == expected
    assert any(c.stopped for c in checks) == stopped
