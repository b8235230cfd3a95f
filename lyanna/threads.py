"""How many compute threads a process that also serves requests should give torch.

The OpenMP team of a forward waits at each barrier for its slowest thread, so a team that
takes every core stalls whenever another thread of the machine (an event loop serving HTTP
or gRPC, a detokenizer, a neighbouring service) takes one of them. Measured on a 2-core
machine: embedded serving at concurrency 1 ran at 96 tokens/s with 2 threads and 190 with 1,
although a bare forward is 1.3-1.8x faster on 2 threads than on 1.
"""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def serving_threads(requested: int = 0, reserved: int = 1) -> int:
    """``requested`` threads, or by default the CPUs less ``reserved`` for the serving
    threads around the computation (at least 1)."""
    if requested < 0 or reserved < 0:
        raise ValueError(f"threads and reserved CPUs must be >= 0, got {requested}, {reserved}")
    return requested or max(1, available_cpus() - reserved)
