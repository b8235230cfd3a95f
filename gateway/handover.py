"""Handing a step's tokens from a compute thread to the event loop that streams them."""

from __future__ import annotations

import asyncio
import threading

SETTLE_HOPS = 4  # event-loop turns the worker waits for after handing over a step's deltas
SETTLE_SECONDS = 0.01  # ... at most this long


def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Wait (briefly) until ``loop`` has run what was just handed to it: the requests
    format and send their tokens now, not while the next step's threads hold every core.
    An OpenMP team waits at each barrier for its slowest thread, so one descheduled by
    the event loop stalled them all (measured on 2 cores: embedded serving at
    concurrency 1 ran at 96 tokens/s on 2 threads, 190 on 1)."""
    done = threading.Event()

    def hop(left: int) -> None:  # each turn runs the tasks the previous one woke
        if left:
            loop.call_soon(hop, left - 1)
        else:
            done.set()

    try:
        loop.call_soon_threadsafe(hop, SETTLE_HOPS)
    except RuntimeError:  # the loop is closed
        return
    done.wait(SETTLE_SECONDS)
