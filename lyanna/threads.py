"""How many compute threads a process that also serves requests should give torch.

The OpenMP team of a forward waits at each barrier for its slowest thread, so a team that
takes every core stalls whenever another thread of the machine (an event loop serving HTTP
or gRPC, a detokenizer, a neighbouring service) takes one of them. Measured on a 2-core
machine: embedded serving at concurrency 1 ran at 96 tokens/s with 2 threads and 190 with 1,
although a bare forward is 1.3-1.8x faster on 2 threads than on 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

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
