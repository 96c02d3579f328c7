"""Which saves a replicas: 2 checkpoint waits for (pscluster/client/cluster_ops.py `_saves`): a PS that holds a
copy or still answers GetRoles is waited for, however slow its save; one that answers nothing and holds no copy
(a SIGSTOPped PS the keeper marked down) is given up and its call cancelled; a save that failed late is not
tried again. The calls are stand-ins for grpc futures; tests/cluster/test_replicated_ps.py runs real daemons."""

import threading
import time
from typing import Any

from pscluster.proto import pscluster_pb2 as pb

from pscluster.client import cluster_ops
from pscluster.client.cluster_ops import ClusterOperations
from pscluster.errors import PsclusterError, UnavailableError


class Call:
    """A started unary call that some test thread finishes (the part of grpc.Future `_saves` uses)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._outcome: Any = None
        self._callbacks: list[Any] = []
        self.cancelled = False

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome

    def add_done_callback(self, fn: Any) -> None:
        self._callbacks.append(fn)

    def finish(self, outcome: Any) -> None:
        with self._lock:
            self._outcome, self._done = outcome, True
        for fn in self._callbacks:
            fn(self)

    def cancel(self) -> bool:
        if self._done:
            return False
        self.cancelled = True
        self.finish(RuntimeError("cancelled"))
        return True


class Table:
    """The client's view of the replica table: who holds a copy, who answered the last refresh."""

    def __init__(self, holders: set[int], live: set[int]) -> None:
        self.version = 3
        self.holders = frozenset(holders)
        self.live = frozenset(live)
        self.refreshes = 0

    def refresh(self) -> bool:
        self.refreshes += 1
        return False


class Ops(ClusterOperations):
    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.retried: list[int] = []

    def _start(self, ps: int, method: str, request: Any) -> Any:
        return self.calls[ps]

    def _translate(self, ps: int, method: str, exc: Exception) -> PsclusterError:
        return exc if isinstance(exc, PsclusterError) else UnavailableError(str(exc))

    def _call(self, ps: int, method: str, request: Any, retry_for: float | None = None) -> Any:
        self.retried.append(ps)
        return pb.SaveReply(path=f"retried-{ps}")

    @property
    def num_ps(self) -> int:
        return len(self.calls)

    def _retrying(self, fn: Any) -> Any:
        return fn()

    def _gather(self, calls: Any) -> Any:
        raise AssertionError("not used")

    def discover(self) -> Any:
        raise AssertionError("not used")

    def pull(self, variables: Any) -> Any:
        raise AssertionError("not used")

    def sync_ps(self) -> int:
        return 0


def test_a_slow_live_save_is_waited_for_and_a_silent_ps_without_copies_is_given_up():
    calls = [Call() for _ in range(4)]
    # ps 0 and 1 hold copies; ps 2 holds none but answers GetRoles (restarted, given nothing yet); ps 3 neither
    table = Table(holders={0, 1}, live={0, 1, 2})
    calls[0].finish(pb.SaveReply(path="0"))
    later = threading.Timer(1.0, lambda: (calls[1].finish(pb.SaveReply(path="1")),
                                         calls[2].finish(pb.SaveReply(path="2"))))
    later.start()
    started = time.monotonic()
    try:
        out = Ops(calls)._saves(table, pb.SaveRequest(step=1))
    finally:
        later.cancel()
    assert [o.path for o in out[:3]] == ["0", "1", "2"]  # both slow ones were waited for (1 s)
    assert time.monotonic() - started >= 0.9
    assert isinstance(out[3], UnavailableError) and "down" in str(out[3])
    assert calls[3].cancelled and table.refreshes >= 2


def test_a_silent_ps_that_still_holds_a_copy_is_waited_for():
    calls = [Call(), Call()]
    table = Table(holders={0, 1}, live={0})  # ps 1 is silent, but its copy is the only one of some shard
    calls[0].finish(pb.SaveReply(path="0"))
    threading.Timer(0.8, lambda: calls[1].finish(pb.SaveReply(path="1"))).start()
    out = Ops(calls)._saves(table, pb.SaveRequest(step=1))
    assert [o.path for o in out] == ["0", "1"] and not calls[1].cancelled


def test_a_save_that_failed_at_once_is_retried_one_that_failed_late_is_not(monkeypatch):
    monkeypatch.setattr(cluster_ops, "SAVE_RETRY_S", 0.5)
    calls = [Call(), Call()]
    table = Table(holders={0, 1}, live={0, 1})
    calls[0].finish(UnavailableError("connection refused"))  # a killed PS: at once
    threading.Timer(0.8, lambda: calls[1].finish(UnavailableError("deadline exceeded"))).start()  # past 0.5 s
    ops = Ops(calls)
    out = ops._saves(table, pb.SaveRequest(step=1))
    assert out[0].path == "retried-0" and isinstance(out[1], UnavailableError)
    assert ops.retried == [0]


def test_nothing_is_given_up_before_the_client_has_seen_a_table():
    calls = [Call(), Call()]
    table = Table(holders=set(), live=set())
    table.version = 0
    calls[0].finish(pb.SaveReply(path="0"))
    threading.Timer(0.8, lambda: calls[1].finish(pb.SaveReply(path="1"))).start()
    out = Ops(calls)._saves(table, pb.SaveRequest(step=1))
    assert [o.path for o in out] == ["0", "1"]
