"""Compute threads beside a server: the CPUs less the serving threads, never below one."""

from __future__ import annotations

import threading

import pytest

from lyanna import threads


@pytest.mark.parametrize(
    ("cpus", "requested", "reserved", "expected"),
    [(2, 0, 1, 1), (16, 0, 1, 15), (16, 0, 2, 14), (1, 0, 2, 1), (16, 3, 1, 3)],
)
def test_threads_leave_cores_to_the_server(
    monkeypatch, tmp_path, cpus, requested, reserved, expected
):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert threads.serving_threads(requested, reserved, cgroup=tmp_path) == expected


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, 64),  # no limit: the affinity
        ({"cpu.max": "800000 100000\n"}, 8),  # a limit of 8 CPUs on a 64-core node
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: a second thread still has time
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 64),
    ],
)
def test_a_container_cpu_limit_bounds_the_cpus(monkeypatch, tmp_path, files, expected) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert threads.available_cpus(tmp_path) == expected
    assert threads.serving_threads(cgroup=tmp_path) == max(1, expected - 1)


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        threads.serving_threads(-1)
    with pytest.raises(ValueError):
        threads.serving_threads(0, reserved=-1)


def test_step_threads_take_every_core_for_large_batches_and_tell_torch_once(monkeypatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(threads, "cpu_quota", lambda cgroup=None: None)
    calls = []
    counts: dict[int, int] = {}  # torch's count per OS thread (1 until set there)

    def set_num_threads(n: int) -> None:
        calls.append(n)
        counts[threading.get_ident()] = n

    monkeypatch.setattr(threads.torch, "set_num_threads", set_num_threads)
    monkeypatch.setattr(
        threads.torch, "get_num_threads", lambda: counts.get(threading.get_ident(), 1)
    )
    policy = threads.StepThreads.serving()
    assert (policy.small, policy.large) == (3, 4)
    assert [policy.apply(n) for n in (1, 2, 4, 16, 3)] == [3, 3, 4, 4, 3]
    assert calls == [3, 4, 3]  # only when the count changes
    policy.apply(16)
    # a server's other worker thread has its own count: the same large batch sets it there
    other = threading.Thread(target=policy.apply, args=(16,))
    other.start()
    other.join()
    assert calls == [3, 4, 3, 4, 4]
    fixed = threads.StepThreads.serving(requested=2)
    assert {fixed.for_batch(n) for n in (1, 4, 16)} == {2}
