"""Stop strings on detokenized text, for the engine's ``Sequence`` and the gateway's stream:
where the first one starts, and how much of the text's end could still grow into one.

``TextStream`` decodes the whole output at each delta and hands out only text that can no
longer change: it holds back a trailing incomplete UTF-8 character (U+FFFD) and any suffix
that could still grow into a stop string, and cuts before the first stop string (OpenAI: the
stop string is not returned). With ``stop=("END",)``, "abc E", "abc EN", "abc ENDx" yield
"abc ", "", "" and stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
Detokenize = Callable[[list[int]], str]


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


class TextStream:
    def __init__(self, detokenize: Detokenize, stop: tuple[str, ...] = ()):
        self._detokenize = detokenize
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # everything handed out so far
        self.stopped = False  # a stop string was found; nothing more will be handed out

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly stable text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self._detokenize(self.token_ids)
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            return self._hand_out(full[:cut])
        end = len(full.rstrip(REPLACEMENT))
        end -= partial_stop_suffix(full[:end], self._stop)
        return self._hand_out(full[:end])

    def flush(self) -> str:
        """The request finished: hand out whatever was held back."""
        if self.stopped:
            return ""
        full = self._detokenize(self.token_ids)
        cut = self._find_stop(full)
        self.stopped = cut is not None
        return self._hand_out(full if cut is None else full[:cut])

    def _hand_out(self, stable: str) -> str:
        if not stable.startswith(self.text) or len(stable) <= len(self.text):
            return ""  # the decoder revised earlier text (rare); never send it twice
        delta = stable[len(self.text) :]
        self.text = stable
        return delta

    def _find_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - self._longest_stop)  # handed-out text held none
        return find_stop(full, self._stop, start)
