"""TextStream: stable text only (no half characters, no text that may turn into a stop
string), cut before the first stop string, the docstring's worked example."""

from __future__ import annotations

from lyanna.stop_strings import TextStream


def stream_of(pieces: dict[int, str], stop: tuple[str, ...] = ()) -> TextStream:
    """Token id i decodes to pieces[i]; a whole output decodes to their concatenation."""
    return TextStream(lambda ids: "".join(pieces[i] for i in ids), stop)


def test_docstring_example() -> None:
    text = stream_of({0: "abc E", 1: "N", 2: "Dx"}, ("END",))
    assert [text.push([0]), text.push([1]), text.push([2])] == ["abc ", "", ""]
    assert text.stopped and text.text == "abc " and text.flush() == ""


def test_partial_stop_is_released_when_it_does_not_complete() -> None:
    text = stream_of({0: "one E", 1: "Nx", 2: " two"}, ("END",))
    assert text.push([0]) == "one "
    assert text.push([1]) == "ENx"
    assert text.push([2]) == " two" and not text.stopped


def test_incomplete_utf8_is_held_back() -> None:
    decoded = {1: "h\ufffd", 2: "hé"}
    text = TextStream(lambda ids: decoded[len(ids)])
    assert text.push([7]) == "h"
    assert text.push([8]) == "é"


def test_flush_hands_out_held_text_and_earliest_stop_wins() -> None:
    text = stream_of({0: "tail S"}, ("STOP",))
    assert text.push([0]) == "tail " and text.flush() == "S"
    text = stream_of({0: "a.b!c"}, ("!", "."))
    assert text.push([0]) == "a" and text.stopped
