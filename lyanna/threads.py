"""How many compute threads a process that also serves requests should give torch.

The OpenMP team of a forward waits at each barrier for its slowest thread, so a team that
takes every core stalls whenever another thread of the machine (an event loop serving HTTP
or gRPC, a detokenizer, a neighbouring service) takes one of them. Measured on a 2-core
machine: embedded serving at concurrency 1 ran at 96 tokens/s with 2 threads and 190 with 1,
although a bare forward is 1.3-1.8x faster on 2 threads than on 1. A step over a large
batch is long next to the serving work it waits on, and there every core pays: at
concurrency 16 the same server ran at 354 tokens/s on 1 thread and 466 with every core from
4 running sequences on (``StepThreads``). The embedded server avoids the clash instead: its
worker lets the event loop send each step's tokens before the next step takes every core
(``gateway.embedded``), which measured faster at every concurrency (221 / 451 / 553-624
tokens/s at 1 / 4 / 16 against 200-208 / 387-397 / 519-532).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs' worth of time the cgroup may use (a Kubernetes CPU limit), or None when
    unlimited: cgroup v2 ``cpu.max`` ("max 100000" or "800000 100000"), else v1's CFS quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


def available_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may use: its affinity mask (a cpuset), bounded by the cgroup's CPU
    quota (a container's CPU limit, which leaves the affinity at every core of the node)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cpu_quota(cgroup)
    if quota is not None:
        cpus = min(cpus or 1, max(1, math.ceil(quota)))
    return cpus or 1


def serving_threads(requested: int = 0, reserved: int = 1, cgroup: Path = CGROUP) -> int:
    """``requested`` threads, or by default the CPUs less ``reserved`` for the serving
    threads around the computation (at least 1)."""
    if requested < 0 or reserved < 0:
        raise ValueError(f"threads and reserved CPUs must be >= 0, got {requested}, {reserved}")
    return requested or max(1, available_cpus(cgroup) - reserved)


@dataclass(slots=True)
class StepThreads:
    """Threads per step by batch size: ``small`` below ``from_batch`` running sequences,
    ``large`` from there on; torch is told only when the count changes."""

    small: int
    large: int
    from_batch: int = 4
    current: int = field(default=0, init=False)

    @classmethod
    def serving(cls, requested: int = 0, reserved: int = 1) -> StepThreads:
        """``requested`` threads always, or by default one core left to the server below
        ``from_batch`` sequences and every core from there."""
        if requested:
            return cls(requested, requested)
        return cls(serving_threads(0, reserved), available_cpus())

    def for_batch(self, running: int) -> int:
        return self.large if running >= self.from_batch else self.small

    def apply(self, running: int) -> int:
        """Set the calling thread's count for a step of ``running`` sequences. torch keeps it
        per OS thread once a thread has run a parallel op (a gRPC server's worker threads
        each hold their own), so it is compared with the caller's, not with the last set."""
        threads = self.for_batch(running)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.current = threads
        return threads
