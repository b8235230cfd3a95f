"""Stop strings on detokenized text, for the engine's ``Sequence`` and the gateway's stream:
where the first one starts, and how much of the text's end could still grow into one."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string found at or after ``start`` begins (None: none)."""
    hits = [i for stop in stops if (i := text.find(stop, start)) >= 0]
    return min(hits) if hits else None


def partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
