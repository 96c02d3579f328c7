"""PsMonitor with fake PS stubs: resumes dispatch after a false alarm; accounts a restart."""

import threading
import types

from pscluster.coordinator.ps_monitor import PsMonitor, VersionRanges
from pscluster.proto import pscluster_pb2 as pb

from pscluster.errors import InternalError


class FakeClient:
    def __init__(self, incarnations):
        self.incarnations = incarnations
        self.restored = 3
        self.stubs = [types.SimpleNamespace(Status=self._status(i), ListShards=self._list) for i in range(len(incarnations))]

    def _status(self, i):
        return lambda request, timeout: pb.PsStatus(ps_index=i, incarnation=self.incarnations[i], restored_step=7)

    def _list(self, request, timeout):
        spec = pb.ShardSpec(variable="w", shard_index=0)
        return pb.ListShardsReply(shards=[pb.ShardInfo(spec=spec, version=9, restored_version=self.restored)])

    def status(self):
        return [s.Status(None, 1.0) for s in self.stubs]

    def recreate_missing(self, ps, primaries=None):
        return 0


def run_until(monitor, event):
    monitor.start()
    assert event.wait(5)
    monitor.stop()


def test_a_wake_with_every_ps_healthy_resumes_dispatch():
    ups = threading.Event()
    monitor = PsMonitor(FakeClient([1, 2]), on_down=lambda: None, on_up=ups.set, interval=10)
    monitor.wake()
    run_until(monitor, ups)
    assert monitor.lost_updates == 0


def test_a_restart_is_accounted_from_reports_of_the_old_incarnation():
    client = FakeClient([1, 2])
    ups = threading.Event()
    monitor = PsMonitor(client, on_down=lambda: None, on_up=ups.set, interval=0.01)
    monitor.record([pb.ShardVersion(variable="w", shard_index=0, version=v, incarnation=1) for v in range(1, 9)])
    client.incarnations[0] = 5  # PS 0 came back from a checkpoint at version 3
    run_until(monitor, ups)
    assert monitor.lost_updates == 5  # versions 4..8
    monitor.record([pb.ShardVersion(variable="w", shard_index=0, version=10, incarnation=1)])  # a late report
    assert monitor.lost_updates == 6  # version 9 was applied by an attempt that failed: its closure re-ran
    assert monitor.lost_updates_by_variable() == {"w": 6}


def test_versions_applied_by_failed_attempts_are_not_lost():
    """The issue's scenario: A pushes (v1) and dies, B pushes (v2) and completes, the PS restores v0."""
    client = FakeClient([1])
    client.restored = 0
    ups = threading.Event()
    monitor = PsMonitor(client, on_down=lambda: None, on_up=ups.set, interval=0.01)
    monitor.record([pb.ShardVersion(variable="w", shard_index=0, version=2, incarnation=1)])  # B
    client.incarnations[0] = 2
    run_until(monitor, ups)
    monitor.record([pb.ShardVersion(variable="w", shard_index=0, version=1, incarnation=2)])  # A, re-run
    assert monitor.lost_updates == 1  # completed 2, counter 1


def test_version_ranges_merge_and_count():
    r = VersionRanges()
    for v in [5, 1, 2, 3, 9, 4, 7, 3]:
        r.add(v)
    assert len(r) == 3  # 1..5, 7, 9
    assert r.count_above(0) == 7 and r.count_above(4) == 3 and r.count_above(9) == 0
    r.drop_through(6)
    assert r.count_above(0) == 2
    for v in range(10, 10_000):
        r.add(v)
    assert len(r) == 2  # consecutive reports stay one range


class GarbageClient(FakeClient):
    """A restarted PS whose ListShards fails `failures` times (a PS answering garbage), then answers."""

    def __init__(self, incarnations, failures):
        super().__init__(incarnations)
        self.failures = failures
        for stub in self.stubs:
            stub.ListShards = self._garbage

    def _garbage(self, request, timeout):
        if self.failures > 0:
            self.failures -= 1
            raise InternalError("ListShards: cannot parse the reply")
        return self._list(request, timeout)


def test_a_failed_check_is_retried_and_dispatch_resumes():
    client = GarbageClient([1], failures=2)
    ups, fatal = threading.Event(), []
    monitor = PsMonitor(client, on_down=lambda: None, on_up=ups.set, interval=0.01, on_fatal=fatal.append)
    client.incarnations[0] = 2
    run_until(monitor, ups)
    assert client.failures == 0 and fatal == [] and monitor.incarnations == [2]


def test_a_check_that_keeps_failing_is_reported_not_lost_with_the_thread():
    client = GarbageClient([1], failures=10**6)
    reported = threading.Event()
    fatal, ups = [], []
    monitor = PsMonitor(client, on_down=lambda: None, on_up=lambda: ups.append(1), interval=0.01,
                        on_fatal=lambda exc: (fatal.append(exc), reported.set()), max_failures=3)
    client.incarnations[0] = 2
    run_until(monitor, reported)
    assert len(fatal) == 1 and isinstance(fatal[0], InternalError) and "cannot parse" in str(fatal[0])
    assert ups == []  # dispatch was never resumed on a half-done accounting
