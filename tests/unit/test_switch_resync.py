"""A move's switch (server/replication.py set_roles): the successor answers before it encodes the shard for
its new backup, so the freeze (it ends with that answer) does not grow with the shard's size; the resync
runs on the replicator's thread afterwards, and no update is lost or applied twice if either side dies
then. In-process PS cores (tests/unit/test_replication.py's link); tests/unit/test_handoff.py moves shards
under concurrent pushes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.errors import UnavailableError
from tests.unit.test_replication import make_core

COUNTER = ("counter", 0)
BIG = ("big", 0)  # 16 MiB of float32


@pytest.fixture
def cores():
    peers: dict[int, ParameterServerCore] = {}
    links: dict = {}
    a, b = make_core(0, peers, links, timeout=0.5), make_core(1, peers, links, timeout=0.5)
    peers.update({0: a, 1: b})
    a.create(ShardSpec("counter", 0, 1, (), (), 0, "<i8", OptimizerConfig("sgd", 1.0)), None, "zeros", 0, 0)
    yield a, b, links
    a.replication.stop()
    b.replication.stop()


def roles(cores: tuple[ParameterServerCore, ...], version: int, primary: int, backup: int = -1,
          keys: tuple[tuple[str, int], ...] = (COUNTER,)) -> None:
    for core in cores:
        core.replication.set_roles(version, [Role(k, version, primary, backup) for k in keys])


def one() -> list[PushItem]:
    return [PushItem(COUNTER, np.array(-1, np.int64))]  # SGD(1.0): +1 per applied push


class Held:
    """A resync that waits for `release` (the encode of a large shard, drawn out): `entered` once it started."""

    def __init__(self, core: ParameterServerCore) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self._resync = core.replication.resync
        core.replication.resync = self  # type: ignore[method-assign]  # the successor's replicator calls this

    def __call__(self, key: tuple[str, int], start: int = 0) -> None:
        self.entered.set()
        assert self.release.wait(10)
        self._resync(key, start)


def caught_up_then_switched(a: ParameterServerCore, b: ParameterServerCore) -> Held:
    """Move COUNTER from a to b as the coordinator does (catch-up, freeze, switch, thaw) with b's resync for
    its new backup a held; returns the hold."""
    roles((a, b), 1, 0, 1)
    a.push("c0.0", 0, one())  # acknowledged: b holds it
    a.freeze_shard(COUNTER, 1, 2.0)
    held = Held(b)
    switched = threading.Thread(target=roles, args=((b, a), 2, 1, 0))
    switched.start()
    switched.join(5)  # the old code encoded inside set_roles: it would wait here for the held resync
    assert not switched.is_alive(), "the switch's SetRoles waited for the resync of the new backup"
    a.thaw_shard(COUNTER)
    assert held.entered.wait(5)  # the replicator's thread runs it after the answer
    return held


def test_the_switch_answers_before_the_new_backup_is_resynced_and_pushes_wait_for_that_state(cores) -> None:
    a, b, _ = cores
    held = caught_up_then_switched(a, b)
    done: list[float] = []
    pusher = threading.Thread(target=lambda: done.append(b.push("c1.0", 0, one())[0].version))
    pusher.start()  # admitted at once (no freeze on b), acknowledged only once a holds the whole state
    time.sleep(0.1)
    assert not done and b.replication.catching_up() == [COUNTER]
    held.release.set()
    pusher.join(5)
    assert done == [2]
    sa, sb = a.store.get(COUNTER), b.store.get(COUNTER)
    assert (sa.version, int(sa.value)) == (sb.version, int(sb.value)) == (2, 2)
    assert sa.record.seen("c1.0") and sa.record.seen("c0.0")
    deadline = time.monotonic() + 5
    while b.replication.catching_up():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_the_successor_dying_right_after_the_switch_loses_no_acknowledged_push(cores) -> None:
    a, b, _ = cores
    held = caught_up_then_switched(a, b)
    errors: list[Exception] = []

    def push() -> None:
        try:
            b.push("c1.0", 0, one())
        except UnavailableError as exc:
            errors.append(exc)

    pusher = threading.Thread(target=push)
    pusher.start()
    time.sleep(0.05)
    # the successor dies before its new backup got the state: what it applied since the switch is not acked
    dying = threading.Thread(target=b.replication.stop)
    dying.start()
    pusher.join(5)
    held.release.set()  # (its thread was inside the held resync; stop joins it)
    dying.join(10)
    assert len(errors) == 1
    roles((a,), 3, 0)  # the coordinator promotes a (its copy holds every acknowledged push)
    assert int(a.store.get(COUNTER).value) in (1, 2)  # c1.0's forward may have reached it, unacknowledged
    a.push("c1.0", 0, one())  # the client retries with the same id: applied once, here or by the forward
    a.push("c1.0", 0, one())
    assert int(a.store.get(COUNTER).value) == 2


def test_the_new_backup_dying_mid_resync_fails_the_wait_and_a_retry_applies_once(cores) -> None:
    a, b, links = cores
    held = caught_up_then_switched(a, b)
    links[0].cut.set()  # the new backup dies while its state is being sent
    held.release.set()
    with pytest.raises(UnavailableError, match="did not confirm"):
        b.push("c1.0", 0, one())  # applied on b, not acknowledged
    roles((b,), 3, 1)  # the failover: b holds the shard alone
    b.push("c1.0", 0, one())  # the retry is deduplicated and acknowledged
    b.push("c2.0", 0, one())
    assert int(b.store.get(COUNTER).value) == 3


def test_a_16_mib_shard_switches_in_a_time_that_does_not_include_its_encode() -> None:
    peers: dict[int, ParameterServerCore] = {}
    links: dict = {}
    a, b = make_core(0, peers, links, timeout=10.0), make_core(1, peers, links, timeout=10.0)
    peers.update({0: a, 1: b})
    try:
        a.create(ShardSpec("big", 0, 1, (1 << 22,), (1 << 22,), 0, "<f4", OptimizerConfig("sgd", 1.0)),
                 None, "ones", 0, 0)
        roles((a, b), 1, 0, 1, (BIG,))
        a.replication.wait([(BIG, 0)])
        a.freeze_shard(BIG, 1, 5.0)
        held = Held(b)
        started = time.perf_counter()
        roles((b,), 2, 1, 0, (BIG,))  # b answers: the freeze ends here
        switch_s = time.perf_counter() - started
        roles((a,), 2, 1, 0, (BIG,))
        a.thaw_shard(BIG)
        assert held.entered.wait(5) and not held.release.is_set()  # the encode had not begun when b answered
        held.release.set()
        b.push("c1.0", 0, [PushItem(BIG, np.ones(1 << 22, np.float32))])
        np.testing.assert_array_equal(a.store.get(BIG).value, b.store.get(BIG).value)
        assert a.store.get(BIG).version == 1 and switch_s < 1.0
    finally:
        a.replication.stop()
        b.replication.stop()
