"""Moving a shard between PS tasks (server/handoff.py): the freeze gate alone, then a whole move between two
in-process PS cores under concurrent pushes, counted exactly (tests/cluster/test_elastic_ps.py does it
between PS daemons)."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from pscluster.server.handoff import ShardGate
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, UnavailableError
from tests.unit.test_replication import KEY, make_core

COUNTER = ("counter", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_frozen_shard_refuses_new_pushes_and_the_freeze_waits_for_admitted_ones() -> None:
    gate = ShardGate(0)
    entered, release = threading.Event(), threading.Event()
    drained: list[float] = []

    def push() -> None:
        with gate.admit([KEY]):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=push)
    t.start()
    entered.wait(5)
    freezer = threading.Thread(target=gate.freeze, args=(KEY, 5.0, drained.append))
    freezer.start()
    time.sleep(0.05)
    assert not drained  # the admitted push has not finished
    with pytest.raises(UnavailableError, match="moving off ps 0"):
        with gate.admit([KEY]):
            pass
    with gate.admit([("other", 0)]):  # other shards are not frozen
        pass
    release.set()
    freezer.join(5)
    t.join(5)
    assert len(drained) == 1 and gate.frozen() == [KEY]
    gate.thaw([KEY])
    with gate.admit([KEY]):
        pass


def test_a_freeze_ends_by_itself_when_its_lease_ends() -> None:
    clock = Clock()
    gate = ShardGate(0, clock)
    gate.freeze(KEY, 0.5, lambda deadline: None)
    assert gate.frozen() == [KEY]
    clock.now = 0.6  # the coordinator died mid-move: pushes resume here
    assert gate.frozen() == []
    with gate.admit([KEY]):
        pass


def test_the_freeze_lease_runs_from_its_last_progress_not_from_its_start() -> None:
    clock = Clock()
    gate = ShardGate(0, clock)
    entered = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    drains: list[float] = []

    def push(i: int) -> None:
        with gate.admit([KEY]):
            entered[i].set()
            release[i].wait(5)

    pushes = [threading.Thread(target=push, args=(i,)) for i in range(2)]
    for i, t in enumerate(pushes):
        t.start()
        assert entered[i].wait(5)
    freezer = threading.Thread(target=gate.freeze, args=(KEY, 1.0, drains.append))
    freezer.start()
    time.sleep(0.05)
    clock.now = 0.9
    release[0].set()  # progress: one admitted push finished within the lease
    pushes[0].join(5)
    time.sleep(0.05)
    clock.now = 1.5  # past the lease counted from the freeze's start, within one from the last progress
    release[1].set()
    pushes[1].join(5)
    freezer.join(5)
    assert drains == [2.5]  # the drain (the backup's confirmation) gets a whole lease from the last progress
    clock.now = 2.4  # the switch gets a whole lease after the freeze returned: still frozen
    assert gate.frozen() == [KEY]
    with pytest.raises(UnavailableError, match="moving off ps 0"):
        with gate.admit([KEY]):
            pass
    clock.now = 2.6
    assert gate.frozen() == []


def test_a_freeze_that_cannot_drain_in_its_lease_is_abandoned_and_thawed() -> None:
    gate = ShardGate(0)
    with gate.admit([KEY]):
        with pytest.raises(DeadlineExceededError, match="1 pushes still in flight"):
            gate.freeze(KEY, 0.05, lambda deadline: None)
    assert gate.frozen() == []


def test_a_failed_drain_thaws_the_shard() -> None:
    gate = ShardGate(0)

    def drain(deadline: float) -> None:
        raise UnavailableError("backup did not confirm")

    with pytest.raises(UnavailableError):
        gate.freeze(KEY, 1.0, drain)
    assert gate.frozen() == []


@pytest.fixture
def cores():
    peers: dict[int, ParameterServerCore] = {}
    links: dict = {}
    a, b = make_core(0, peers, links), make_core(1, peers, links)
    peers.update({0: a, 1: b})
    spec = ShardSpec("counter", 0, 1, (), (), 0, "<i8", OptimizerConfig("sgd", 1.0))
    a.create(spec, None, "zeros", 0, 0)
    yield a, b
    a.replication.stop()
    b.replication.stop()


def roles(cores: tuple[ParameterServerCore, ...], version: int, primary: int, backup: int = -1) -> None:
    for core in cores:
        core.replication.set_roles(version, [Role(COUNTER, version, primary, backup)])


def test_freezing_needs_the_successor_as_backup_and_bad_input_changes_nothing(cores) -> None:
    a, b = cores
    roles((a, b), 1, 0)
    with pytest.raises(FailedPreconditionError, match="ps 1 is not its backup"):
        a.freeze_shard(COUNTER, 1, 1.0)
    with pytest.raises(InvalidArgumentError, match="lease"):
        a.freeze_shard(COUNTER, 1, 0.0)
    with pytest.raises(UnavailableError, match="not the primary"):
        b.freeze_shard(COUNTER, 0, 1.0)
    assert a.gate.frozen() == [] and b.gate.frozen() == []
    a.push("c1.0", 0, [PushItem(COUNTER, np.array(-1, np.int64))])  # still admitted


def test_a_shard_moved_back_and_forth_under_concurrent_pushes_counts_every_acknowledged_push_once(cores) -> None:
    a, b = cores
    by_index = {0: a, 1: b}
    primary = [0]  # the clients' view of the table (routes.py re-reads it after a refusal)
    roles((a, b), 1, 0)
    ids = itertools.count()
    acked = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            pid = f"c{next(ids)}.0"
            while True:  # the same push id until acknowledged, wherever the shard is
                try:
                    by_index[primary[0]].push(pid, 0, [PushItem(COUNTER, np.array(-1, np.int64))])
                    break
                except UnavailableError:
                    time.sleep(0.001)
            with lock:
                acked[0] += 1

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    freezes = []
    version = 1
    for source, target in ((0, 1), (1, 0), (0, 1)):
        time.sleep(0.05)
        version += 1
        roles((a, b), version, source, target)  # the successor becomes the backup and catches up
        deadline = time.monotonic() + 5
        while by_index[source].replication.catching_up():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        started = time.perf_counter()
        by_index[source].freeze_shard(COUNTER, target, 2.0)
        version += 1
        roles((by_index[target], by_index[source]), version, target)  # the switch: new primary first
        primary[0] = target
        by_index[source].thaw_shard(COUNTER)
        freezes.append(time.perf_counter() - started)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert acked[0] > 0
    assert int(b.store.get(COUNTER).value) == acked[0]  # SGD(1.0) on -1: every acknowledged push, once
    assert max(freezes) < 1.0


def test_a_sync_freeze_admits_the_open_steps_pushes_and_refuses_the_next_steps() -> None:
    gate = ShardGate(0)
    entered, release = threading.Event(), threading.Event()

    def first_replica() -> None:  # step 4's first gradient: it waits for the step's other replicas
        with gate.admit([KEY], 4):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=first_replica)
    t.start()
    assert entered.wait(5)
    drained: list[float] = []
    freezer = threading.Thread(target=gate.freeze, args=(KEY, 5.0, drained.append), kwargs={"between_steps": True})
    freezer.start()
    time.sleep(0.05)
    with gate.admit([KEY], 4):  # step 4's other replica: the step is open, so it still lands here
        pass
    with pytest.raises(UnavailableError, match="moving off ps 0"):
        with gate.admit([KEY], 5):  # the next step goes to the successor
            pass
    assert not drained
    release.set()  # step 4 settles
    freezer.join(5)
    t.join(5)
    assert len(drained) == 1
    with pytest.raises(UnavailableError, match="moving off ps 0"):
        with gate.admit([KEY], 4):  # settled: a late straggler of step 4 goes to the successor too
            pass


def test_a_sync_job_moves_a_shard_between_two_steps_and_applies_every_step_once(cores) -> None:
    a, b = cores
    by_index = {0: a, 1: b}
    w = ("w", 0)
    a.create(ShardSpec("w", 0, 1, (), (), 0, "<f8", OptimizerConfig("sgd", 1.0)), None, "zeros", 0, 0)
    primary = [0]
    roles_w = {"version": 1}

    def set_roles(primary_ps: int, backup: int) -> None:
        roles_w["version"] += 1
        for core in (by_index[primary_ps], by_index[1 - primary_ps]):  # the new primary first
            core.replication.set_roles(roles_w["version"], [Role(w, roles_w["version"], primary_ps, backup)])

    set_roles(0, 1)
    for core in (a, b):
        core.sync.configure("sync", 2, 2, 0)
    steps = 300
    barrier = threading.Barrier(2)  # the token queue: a step starts once both replicas finished the last one
    failures: list[BaseException] = []
    moved = threading.Event()  # the last steps wait for the moves: each move falls under training, however fast

    def replica(i: int) -> None:
        try:
            for step in range(steps):
                if step == steps - 10:
                    moved.wait(20)
                while True:  # the same push id until acknowledged, wherever the shard is
                    try:
                        by_index[primary[0]].push(f"r{i}.{step}", step, [PushItem(w, np.array(-1.0))])
                        break
                    except UnavailableError:
                        time.sleep(0.001)
                barrier.wait(10)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    during: list[float] = []  # steps applied when each move switched
    for source, target in ((0, 1), (1, 0), (0, 1)):
        time.sleep(0.03)
        deadline = time.monotonic() + 5
        while float(by_index[source].store.get(w).value) == 0:  # a step applied before the first move
            assert time.monotonic() < deadline
            time.sleep(0.001)
        deadline = time.monotonic() + 5
        while by_index[source].replication.catching_up():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        by_index[source].freeze_shard(w, target, 2.0)
        during.append(float(by_index[source].store.get(w).value))
        set_roles(target, source)  # the switch; the old primary stays its backup
        primary[0] = target
        by_index[source].thaw_shard(w)
    moved.set()
    for t in threads:
        t.join(20)
    assert not failures
    assert float(by_index[primary[0]].store.get(w).value) == steps  # every step's average (-1) applied once
    assert a.sync.dropped == 0 and b.sync.dropped == 0
    assert 0 < during[0] < during[-1] < steps, during  # the moves fell between steps, under training


def test_the_old_holder_drops_its_copy_only_once_the_table_gives_it_no_role(cores) -> None:
    a, b = cores
    assert not a.thaw_shard(COUNTER, drop=True)  # no table yet: keep it
    roles((a, b), 1, 0, 1)
    a.replication.wait([(COUNTER, a.store.get(COUNTER).version)])
    assert not a.thaw_shard(COUNTER, drop=True)  # still its primary
    roles((b, a), 2, 1)  # moved: ps 1 alone
    assert not b.thaw_shard(COUNTER, drop=True)
    assert a.thaw_shard(COUNTER, drop=True) and a.store.find(COUNTER) is None
    assert b.store.find(COUNTER) is not None


def test_a_thaw_while_the_freeze_waits_for_admitted_pushes_is_not_undone_by_their_progress() -> None:
    gate = ShardGate(0)
    entered, release = threading.Event(), threading.Event()
    drained: list[float] = []
    errors: list[BaseException] = []

    def push() -> None:
        with gate.admit([KEY]):
            entered.set()
            release.wait(5)

    def freeze() -> None:
        try:
            gate.freeze(KEY, 30.0, drained.append)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=push)
    t.start()
    assert entered.wait(5)
    freezer = threading.Thread(target=freeze)
    freezer.start()
    deadline = time.monotonic() + 10
    while gate.frozen() != [KEY] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert gate.frozen() == [KEY]
    gate.thaw([KEY])  # the coordinator's FreezeShard timed out: it gave the move up
    release.set()  # the admitted push finishes: progress, which must not freeze the shard again
    t.join(5)
    freezer.join(5)
    assert not freezer.is_alive() and not drained
    assert len(errors) == 1 and isinstance(errors[0], UnavailableError) and "thawed" in str(errors[0])
    assert gate.frozen() == []
    with gate.admit([KEY]):  # pushes are admitted at once, not refused for a lease
        pass
