"""API keys and per-key limits for the HTTP surface.

Keys come from ``LYANNA_API_KEYS`` and optionally a file, one key per line (``#`` comments),
read again when it changes (looked at once a second at most), so keys rotate without a
restart; an unreadable or emptied file keeps the last keys rather than opening the door.
Keys are compared in constant time."""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from collections import deque
from pathlib import Path

logger = logging.getLogger(__name__)

RELOAD_SECONDS = 1.0  # how often the key file's modification time is looked at
MAX_KEYS = 10_000
MAX_KEY_BYTES = 256


def read_key_file(path: str | Path) -> tuple[bytes, ...]:
    keys = [k for line in Path(path).read_text().splitlines() if (k := line.split("#")[0].strip())]
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{path} holds more than {MAX_KEYS} keys")
    if any(len(k.encode()) > MAX_KEY_BYTES for k in keys):
        raise ValueError(f"an API key in {path} is longer than {MAX_KEY_BYTES} bytes")
    return tuple(k.encode() for k in keys)


class KeyRing:
    """The accepted keys: fixed ones plus a reloadable file; empty = no authentication."""

    def __init__(self, keys: tuple[str, ...] = (), key_file: str = "") -> None:
        self._fixed = tuple(k.encode() for k in keys)
        self._file, self._checked = key_file, 0.0
        # fail at start on a bad file
        self._from_file = read_key_file(key_file) if key_file else ()
        self._mtime = os.stat(key_file).st_mtime if key_file else None
        self.enabled = bool(self._fixed or self._file)

    def match(self, authorization: bytes) -> bytes | None:
        """The key a ``Bearer`` authorization header carries, if it is accepted."""
        scheme, _, key = authorization.partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            return None
        self._maybe_reload()
        found = None
        for candidate in (*self._fixed, *self._from_file):  # no early exit: constant time
            if hmac.compare_digest(key, candidate):
                found = candidate
        return found

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if not self._file or now - self._checked < RELOAD_SECONDS:
            return
        self._checked = now
        try:
            mtime = os.stat(self._file).st_mtime
            if mtime == self._mtime:
                return
            keys = read_key_file(self._file)
            if not keys:
                raise ValueError("it is empty")
        except (OSError, ValueError) as error:
            logger.warning("API key file not reloaded (%s); keeping the last keys", error)
            return
        self._from_file, self._mtime = keys, mtime
        logger.info("reloaded %d API keys from %s", len(keys), self._file)


class StreamLimiter:
    """Requests in flight per key; ``limit`` 0 = unbounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[bytes, int] = {}

    def acquire(self, key: bytes) -> bool:
        count = self._active.get(key, 0)
        if self.limit and count >= self.limit:
            return False
        self._active[key] = count + 1
        return True

    def release(self, key: bytes) -> None:
        count = self._active.pop(key, 0) - 1
        if count > 0:
            self._active[key] = count


class TokenRateLimiter:
    """Tokens (prompt + output) per key over a sliding minute; ``limit`` 0 = unbounded.

    The check comes before a request runs and its charge after, so one request may overshoot
    the limit by its own size (as OpenAI's limits do)."""

    WINDOW = 60.0

    def __init__(self, limit: int, clock=time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._charges: dict[bytes, deque[tuple[float, int]]] = {}
        self._used: dict[bytes, int] = {}

    def retry_after(self, key: bytes) -> int:
        """0 when ``key`` may start a request now, else whole seconds until it may."""
        if not self.limit:
            return 0
        now = self._clock()
        self._expire(key, now)
        charges, used = self._charges.get(key), self._used.get(key, 0)
        if used < self.limit or not charges:
            return 0
        for when, tokens in charges:  # oldest first: wait until the excess has aged out
            used -= tokens
            if used < self.limit:
                return max(1, math.ceil(when + self.WINDOW - now))
        return math.ceil(self.WINDOW)

    def charge(self, key: bytes, tokens: int) -> None:
        if not self.limit or tokens <= 0:
            return
        now = self._clock()
        self._expire(key, now)
        self._charges.setdefault(key, deque()).append((now, tokens))
        self._used[key] = self._used.get(key, 0) + tokens

    def _expire(self, key: bytes, now: float) -> None:
        charges = self._charges.get(key)
        while charges and charges[0][0] <= now - self.WINDOW:
            self._used[key] -= charges.popleft()[1]
        if charges is not None and not charges:
            del self._charges[key]
            self._used.pop(key, None)
