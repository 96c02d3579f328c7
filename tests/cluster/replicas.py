"""What the replicas: 2 cluster tests share: polling the replica table, a call looped on a thread, a SIGSTOP."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

import pscluster as ps


def increment(*counters: ps.Variable) -> int:
    """A closure body: one -1 push (SGD(1.0): +1) to each int64 counter; returns 1 (closures completed)."""
    for counter in counters:
        counter.push(np.array(-1, np.int64))
    return 1


def poll(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll a cluster condition with a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def primary_of(coord: ps.ClusterCoordinator, key: tuple[str, int]):
    """The shard's copies in the coordinator's replica table (None before it has them)."""
    return coord.replica_table().get(key)


class CallLoop:
    """Calls `call()` on its own thread until stopped; `acked` holds the time each call returned. The first
    PsclusterError ends the loop and is kept in `errors` (the tests assert there is none)."""

    def __init__(self, call: Callable[[], object], name: str) -> None:
        self.acked: list[float] = []
        self.errors: list[BaseException] = []
        self._call = call
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> CallLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=20)
        assert not self._thread.is_alive(), f"{self._thread.name} did not stop"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._call()
            except ps.PsclusterError as exc:
                self.errors.append(exc)
                return
            self.acked.append(time.monotonic())


@contextlib.contextmanager
def sigstopped(pid: int) -> Iterator[float]:
    """SIGSTOP pid for the block (yields when it was stopped); SIGCONT however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_rejoined_as_backup(coord: ps.ClusterCoordinator, key: tuple[str, int], task: int) -> None:
    """Wait until PS `task` holds shard `key` again as its in-sync backup."""
    poll(lambda: (c := primary_of(coord, key)) is not None and c.backup == task and c.in_sync,
         f"PS {task} to rejoin as the backup of {key}")
