"""Compute threads beside a server: the CPUs less the serving threads, never below one."""

from __future__ import annotations

import pytest

from lyanna import threads


@pytest.mark.parametrize(
    ("cpus", "requested", "reserved", "expected"),
    [(2, 0, 1, 1), (16, 0, 1, 15), (16, 0, 2, 14), (1, 0, 2, 1), (16, 3, 1, 3)],
)
def test_threads_leave_cores_to_the_server(monkeypatch, cpus, requested, reserved, expected):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert threads.serving_threads(requested, reserved) == expected


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        threads.serving_threads(-1)
    with pytest.raises(ValueError):
        threads.serving_threads(0, reserved=-1)
