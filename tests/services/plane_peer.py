"""A gloo data-plane pair for tests: this process is the drafter (rank 1, the receiver), a
spawned child the verifier (rank 0), driven by commands over a pipe. The child records the tag
of every point-to-point call it makes."""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.data_plane import DataPlane
from services.launch import free_port

CALL_SECONDS = 60.0  # the most any command to the child may take (spawning imports torch)


def rows_of(rows: int, columns: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
    """A transfer's rows, distinct for each ``fill``: both processes build the same."""
    values = torch.arange(rows * columns, dtype=torch.float64).reshape(rows, columns)
    return (values + 100 * fill).to(dtype)


def _recording(function, tags: list[tuple[str, int]]):
    signature = inspect.signature(function)

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tags.append((function.__name__, bound.arguments["tag"]))
        return function(*args, **kwargs)

    return wrapper


def record_tags(patch) -> list[tuple[str, int]]:
    """Wrap torch.distributed's point-to-point calls (with ``patch(module, name, value)``)
    to record (call, tag) of each."""
    tags: list[tuple[str, int]] = []
    for name in ("send", "isend", "recv", "irecv"):
        patch(dist, name, _recording(getattr(dist, name), tags))
    return tags


def _serve(addr: str, conn) -> None:
    """The verifier side: connect, then run commands until told to stop (or left alone)."""
    tags = record_tags(setattr)
    plane = DataPlane("gloo", addr, 0, timeout_seconds=30)
    plane.connect_in_background()
    if not plane.wait_ready(CALL_SECONDS):
        conn.send(("error", "not ready"))
        return
    conn.send(("ready",))
    kept = []
    while conn.poll(CALL_SECONDS):
        command, *args = conn.recv()
        if command == "send":  # rows, columns, dtype name, fill
            rows, columns, dtype, fill = args
            conn.send(plane.send(rows_of(rows, columns, getattr(torch, dtype), fill)))
        elif command == "raw":  # a message outside the protocol: int64 values
            raw = torch.tensor(args[0], dtype=torch.int64)
            kept.append((dist.isend(raw, dst=1, tag=0), raw))  # received on demand only
            conn.send("sent")
        elif command == "tags":
            conn.send(list(tags))
        elif command == "die":
            os._exit(0)
        elif command == "close":
            plane.close()
            conn.send("closed")
            return


@dataclass
class Peer:
    plane: DataPlane  # this process's, rank 1
    conn: object
    process: mp.Process

    def call(self, *command):
        self.conn.send(command)
        assert self.conn.poll(CALL_SECONDS), f"the peer did not answer {command}"
        return self.conn.recv()

    def send(self, rows: int, columns: int, dtype: str = "float32", fill: int = 0) -> int:
        return self.call("send", rows, columns, dtype, fill)


@contextlib.contextmanager
def plane_peer() -> Iterator[Peer]:
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    addr = f"127.0.0.1:{free_port()}"
    process = context.Process(target=_serve, args=(addr, child_conn), daemon=True)
    process.start()
    child_conn.close()  # the child's end lives in the child only: its death reads as EOF
    plane = DataPlane("gloo", addr, 1, timeout_seconds=30)
    try:
        plane.connect_in_background()
        assert plane.wait_ready(CALL_SECONDS), "the data plane did not form"
        assert conn.poll(CALL_SECONDS) and conn.recv() == ("ready",)
        yield Peer(plane, conn, process)
    finally:
        if process.is_alive():
            with contextlib.suppress(OSError, EOFError):
                conn.send(("close",))
                conn.poll(CALL_SECONDS)
        plane.close()
        process.join(CALL_SECONDS)
        if process.is_alive():
            process.kill()
        if dist.is_initialized():  # a broken plane leaves its group: the next test forms one
            dist.destroy_process_group()
