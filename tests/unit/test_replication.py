"""PS-to-PS replication (server/replication.py) between two in-process PS cores.

The link hands the serialized request and its payload to the other core's `receive` (what the bulk
port's replicate handler does); it can be cut to play a backup that does not answer.
tests/cluster/test_replicated_ps.py runs replication between real daemons.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import sync_replicas
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replica_links import payload_views
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.errors import UnavailableError

KEY = ("w", 0)
ROWS = ("emb", 0)


class Link:
    """Replicate to an in-process core through the wire format; `cut` makes it fail as a dead peer."""

    def __init__(self, target: ParameterServerCore) -> None:
        self.target = target
        self.cut = threading.Event()
        self.batches = 0

    def replicate(self, request: pb.ReplicateRequest, arrays: list[np.ndarray], timeout: float) -> pb.ReplicateReply:
        if self.cut.is_set():
            raise UnavailableError("backup unreachable (cut by the test)")
        self.batches += 1
        # the framed wire format: the header, then the arrays' bytes as one payload the backup cuts up
        parsed = pb.ReplicateRequest.FromString(request.SerializeToString())
        payload = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]) \
            if arrays else np.empty(0, np.uint8)
        reply = self.target.replication.receive(parsed, payload_views(parsed, payload))
        return pb.ReplicateReply.FromString(reply.SerializeToString())

    def close(self) -> None:
        pass


def make_core(index: int, peers: dict[int, ParameterServerCore], links: dict[int, Link],
              timeout: float = 2.0) -> ParameterServerCore:
    core = ParameterServerCore(index, 2)
    sync_replicas.attach(core)

    def connect(ps: int) -> Link:
        return links.setdefault(ps, Link(peers[ps]))

    core.replication = Replication(core.store, index, connect, timeout=timeout)
    core.replication.sync_state = core.sync
    return core


@pytest.fixture
def pair():
    peers: dict[int, ParameterServerCore] = {}
    links: dict[int, Link] = {}
    a, b = make_core(0, peers, links), make_core(1, peers, links)
    peers.update({0: a, 1: b})
    yield a, b, links
    a.replication.stop()
    b.replication.stop()


def create(core: ParameterServerCore, optimizer: str = "adam") -> None:
    core.create(ShardSpec("w", 0, 1, (4,), (4,), 0, "<f4", OptimizerConfig(optimizer, 0.1)), None, "ones", 0, 0)
    core.create(ShardSpec("emb", 0, 1, (6, 2), (6, 2), 0, "<f4", OptimizerConfig("sgd", 1.0)), None, "zeros", 0, 0)


def table(version: int, epoch: int, primary: int, backup: int = -1) -> tuple[int, list[Role]]:
    return version, [Role(k, epoch, primary, backup) for k in (KEY, ROWS)]


def roles(a: ParameterServerCore, b: ParameterServerCore, epoch: int = 1) -> None:
    for core in (b, a):
        core.replication.set_roles(*table(epoch, epoch, 0, 1))
    a.replication.wait([(k, a.store.get(k).version) for k in (KEY, ROWS)])  # the catch-up landed


def same(a: ParameterServerCore, b: ParameterServerCore, key: tuple[str, int]) -> None:
    sa, sb = a.store.get(key), b.store.get(key)
    assert sa.version == sb.version
    np.testing.assert_array_equal(sa.value, sb.value)
    assert sa.slots.keys() == sb.slots.keys()
    for name in sa.slots:
        np.testing.assert_array_equal(sa.slots[name], sb.slots[name])


def grad(x: float) -> np.ndarray:
    return np.full(4, x, np.float32)


def test_a_new_backup_gets_the_whole_shard_then_every_push_before_it_is_acknowledged(pair):
    a, b, _ = pair
    create(a)
    with pytest.raises(UnavailableError, match="no replica table entry"):  # not one copy: refused until known
        a.push("c1.0", 0, [PushItem(KEY, grad(0.5))])
    assert a.store.get(KEY).version == 0
    roles(a, b)
    a.push("c1.0", 0, [PushItem(KEY, grad(0.5))])
    for i in range(5):
        result = a.push(f"c{2 + i}.0", 0, [PushItem(KEY, grad(0.1 * i))])[0]
        assert result.applied and b.store.get(KEY).version >= result.version  # held by the backup on reply
    same(a, b, KEY)  # value, Adam's slots and version
    assert b.store.get(KEY).record.seen("c4.0") and b.store.get(KEY).record.seen("c1.0")


def test_sparse_row_updates_reach_the_backup(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    a.push("c1.0", 0, [PushItem(ROWS, np.ones((2, 2), np.float32), np.array([5, 1], np.int64))])
    same(a, b, ROWS)
    assert b.store.get(ROWS).value[5, 0] == -1.0


def test_a_push_retried_on_the_promoted_backup_is_not_applied_twice(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    a.push("c7.0", 0, [PushItem(KEY, grad(1.0))])
    # the primary dies; the coordinator promotes the backup at epoch 2; the worker retries with the same id
    b.replication.set_roles(*table(2, 2, 1))
    again = b.push("c7.0", 0, [PushItem(KEY, grad(1.0))])[0]
    assert not again.applied and again.version == 1 and b.store.get(KEY).version == 1


def test_a_push_to_the_backup_is_refused_and_changes_nothing(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    before = b.store.get(KEY).value.copy()
    with pytest.raises(UnavailableError, match="not the primary"):
        b.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
    np.testing.assert_array_equal(b.store.get(KEY).value, before)


def test_a_deposed_primary_cannot_change_the_backup_nor_acknowledge(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
    b.replication.set_roles(*table(2, 2, 1))  # promoted: the old primary is deposed
    before = b.store.get(KEY).value.copy()
    with pytest.raises(UnavailableError, match="no longer the primary"):
        a.push("c2.0", 0, [PushItem(KEY, grad(1.0))])
    np.testing.assert_array_equal(b.store.get(KEY).value, before)
    assert b.store.get(KEY).version == 1


def test_an_unreachable_backup_holds_the_reply_until_it_answers_and_the_retry_is_acknowledged(pair):
    a, b, links = pair
    create(a)
    roles(a, b)
    links[1].cut.set()
    with pytest.raises(UnavailableError, match="did not confirm"):
        a.replication.timeout = 0.2
        a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
    assert b.store.get(KEY).version == 0
    links[1].cut.clear()
    a.replication.timeout = 2.0
    retry = a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])[0]  # the worker's retry: held, now confirmed
    assert not retry.applied and retry.version == 1
    same(a, b, KEY)


def test_a_backup_that_lost_its_shards_is_sent_the_whole_state(pair):
    a, b, links = pair
    create(a)
    roles(a, b)
    a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
    # the backup restarts empty (a new core at the same address); the next update finds a gap
    fresh = make_core(1, {0: a}, {})
    fresh.replication.set_roles(*table(1, 1, 0, 1))
    links[1].target = fresh
    a.push("c2.0", 0, [PushItem(KEY, grad(2.0))])
    same(a, fresh, KEY)
    assert fresh.store.get(KEY).record.seen("c1.0")
    fresh.replication.stop()


def test_a_sync_step_sends_its_one_aggregated_update_and_its_replies_wait_for_it(pair):
    a, b, links = pair
    create(a, "sgd")
    a.sync.configure("sync", 2, 2, 0)
    roles(a, b)
    batches = links[1].batches
    first: list = []
    waiting = threading.Thread(target=lambda: first.extend(a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and not first  # accumulated, not acknowledged: the step has not been applied
    assert links[1].batches == batches  # nothing forwarded for a gradient alone
    a.push("c2.0", 0, [PushItem(KEY, grad(3.0))])
    waiting.join(timeout=5)
    assert first and first[0].applied
    same(a, b, KEY)
    assert b.store.get(KEY).version == 1 and b.store.get(KEY).value[0] == pytest.approx(1.0 - 0.1 * 2.0)
    assert b.store.get(KEY).record.seen("sync:0")


def test_a_sync_push_retried_on_the_promoted_backup_after_its_step_applied_returns_at_once(pair):
    # the primary applied step 0 and replicated it, then died before replying to the second replica: that
    # replica's retry must not open step 0 again on the new primary (no other replica would ever fill it)
    a, b, _ = pair
    create(a, "sgd")
    for core in (a, b):
        core.sync.configure("sync", 2, 2, 0)
    roles(a, b)
    first = threading.Thread(target=lambda: a.push("c1.0", 0, [PushItem(KEY, grad(1.0))]))
    first.start()
    a.push("c2.0", 0, [PushItem(KEY, grad(3.0))])
    first.join(timeout=5)
    b.replication.set_roles(*table(2, 2, 1))  # the primary died; the backup is promoted
    started = time.monotonic()
    again = b.push("c2.0", 0, [PushItem(KEY, grad(3.0))])[0]
    assert time.monotonic() - started < 1.0  # not a wait for the step's other gradient
    assert not again.applied and again.version == 1
    assert b.store.get(KEY).value[0] == pytest.approx(1.0 - 0.1 * 2.0) and b.sync.dropped == 0
    # the next step accumulates on the new primary as usual
    third = threading.Thread(target=lambda: b.push("c3.0", 1, [PushItem(KEY, grad(1.0))]))
    third.start()
    b.push("c4.0", 1, [PushItem(KEY, grad(1.0))])
    third.join(timeout=5)
    assert b.store.get(KEY).version == 2 and b.store.get(KEY).value[0] == pytest.approx(0.8 - 0.1)


def test_concurrent_pushes_reach_the_backup_in_the_primary_order(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)

    def worker(w: int) -> None:
        for i in range(40):
            a.push(f"c{w * 100 + i}.0", 0, [PushItem(KEY, grad(0.01 * (w + 1)))])

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert a.store.get(KEY).version == 160
    same(a, b, KEY)


def test_a_primary_reports_the_shards_whose_new_backup_has_not_confirmed_their_state(pair):
    a, b, links = pair
    create(a)
    links[1] = Link(b)
    links[1].cut.set()
    for core in (b, a):
        core.replication.set_roles(*table(1, 1, 0, 1))
    assert a.replication.catching_up() == sorted([KEY, ROWS])
    links[1].cut.clear()
    a.replication.wait([(k, 0) for k in (KEY, ROWS)])
    assert a.replication.catching_up() == []
    assert a.replication.roles() == table(1, 1, 0, 1)[:1] + ([Role(KEY, 1, 0, 1), Role(ROWS, 1, 0, 1)],)


def test_a_pull_from_the_backup_is_refused(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    with pytest.raises(UnavailableError, match="not the primary"):
        b.pull([(KEY, None)])
    assert a.pull([(KEY, None)])[0][1] == 0


def test_a_config_change_racing_a_forward_reaches_the_backup_in_the_primary_order(pair):
    a, b, links = pair
    create(a)
    roles(a, b)
    links[1].cut.set()  # the push's forward waits in the queue while the change is made
    pushed = threading.Thread(target=a.push, args=("c1.0", 0, [PushItem(KEY, grad(1.0))]))
    pushed.start()
    while a.store.get(KEY).version < 1:
        pass
    changed: list[tuple[int, list[str]]] = []
    change = threading.Thread(target=lambda: changed.append(a.set_hyperparameters(["w"], '{"learning_rate": 0.5}')))
    change.start()
    # the client's fan-out reaches the backup first: its copy changes only through the stream
    assert b.set_hyperparameters(["w"], '{"learning_rate": 0.5}') == (0, [])
    assert b.store.get(KEY).spec.optimizer.learning_rate == pytest.approx(0.1)
    links[1].cut.clear()
    pushed.join(timeout=10)
    change.join(timeout=10)
    assert changed == [(1, ["w"])]
    assert b.store.get(KEY).spec.optimizer.learning_rate == pytest.approx(0.5)
    same(a, b, KEY)  # the push applied with 0.1 on both
    a.push("c2.0", 0, [PushItem(KEY, grad(1.0))])
    same(a, b, KEY)  # and the next one with 0.5 on both


def test_a_refusal_of_a_forward_sent_before_the_role_changed_does_not_depose_the_primary(pair):
    a, b, links = pair
    create(a)
    roles(a, b)
    b.replication.set_roles(*table(2, 2, 0, 1))  # the backup learns epoch 2 first
    sent, release = threading.Event(), threading.Event()
    link = links[1]
    plain = link.replicate

    def held(request, arrays, timeout):
        sent.set()
        release.wait(10)  # the refusal of this epoch-1 forward comes back after the primary learned epoch 2
        return plain(request, arrays, timeout)

    link.replicate = held
    # its push is acknowledged by the catch-up the new epoch sends (which holds it)
    pushed = threading.Thread(target=a.push, args=("c1.0", 0, [PushItem(KEY, grad(1.0))]))
    pushed.start()
    assert sent.wait(10)
    link.replicate = plain
    changed = threading.Thread(target=a.replication.set_roles, args=table(2, 2, 0, 1))
    changed.start()
    release.set()
    changed.join(10)
    pushed.join(10)
    a.push("c2.0", 0, [PushItem(KEY, grad(1.0))])  # acknowledged at epoch 2: not refused as deposed
    same(a, b, KEY)


def test_a_push_whose_primary_lost_its_role_while_waiting_is_not_acknowledged(pair):
    """The wait for the backup must not end in an acknowledgement when this PS stopped being the shard's
    primary meanwhile: the backup may never hold the update (found by review; it broke out as confirmed)."""
    a, b, links = pair
    create(a)
    roles(a, b)
    links[1].cut.set()  # the forward cannot land
    done: list[BaseException | None] = []

    def push() -> None:
        try:
            a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects what the push raised
            done.append(exc)

    pusher = threading.Thread(target=push)
    pusher.start()
    time.sleep(0.2)  # the push waits for the backup's confirmation
    a.replication.set_roles(*table(2, 2, 1))  # the coordinator promoted the backup
    pusher.join(5)
    assert not pusher.is_alive() and isinstance(done[0], UnavailableError), done
    assert b.store.get(KEY).version == 0  # the backup never held it: the worker retries on ps 1


def test_a_push_on_a_stopping_primary_is_not_acknowledged_without_its_backup(pair):
    a, b, _ = pair
    create(a)
    roles(a, b)
    a.replication.stop()  # shutdown: the replicators are gone
    with pytest.raises(UnavailableError, match="no longer its primary or is stopping"):
        a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])


def test_a_catch_up_whose_snapshot_fails_is_tried_again_and_the_sender_lives_on():
    """A resync that raises (a failed snapshot) must not end the replicator's thread: it was the only
    sender of catch-ups and resends, so the backup fell behind for good (found by review)."""
    from pscluster.server.replicator import Replicator

    class Accepting:
        def replicate(self, request, arrays, timeout):
            n = len(request.forwards)
            return pb.ReplicateReply(outcomes=[pb.REPLICA_APPLIED] * n, versions=[f.version for f in request.forwards])

        def close(self) -> None:
            pass

    calls: list[tuple[str, int]] = []

    def resync(key, start=0) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise MemoryError("the snapshot's copy failed")

    rep = Replicator(1, Accepting(), 0, 1.0, resync, max_queued_bytes=8)
    try:
        rep.keys.update({KEY, ROWS})
        msg = pb.ReplicaForward(ref=pb.ShardRef(variable="w", shard_index=0), epoch=1, version=1)
        with rep._cond:  # hold the queue so the second put finds the first one still there: over the limit
            rep._sending = True
        rep.put(KEY, 1, msg, [np.zeros(2, np.float32)])
        rep.put(ROWS, 1, msg, [np.zeros(2, np.float32)])  # over max_queued_bytes: ROWS is resynced instead
        with rep._cond:
            rep._sending = False
            rep._wake_sender()
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [ROWS, ROWS] and rep._thread.is_alive()
    finally:
        rep.stop()


def test_a_sync_push_retried_on_the_promoted_backup_after_its_step_was_skipped_returns_at_once(pair):
    # a replica's gradient was not finite (R = N = 2): the step is skipped on the primary, which changes no
    # version, then the primary died before replying to the finite replica: its retry on the new primary must
    # not open the step again (the skipping replica got its reply and will not push it again)
    a, b, _ = pair
    create(a, "sgd")
    for core in (a, b):
        core.sync.configure("sync", 2, 2, 0)
        core.replication.step_timeout = 3.0
    roles(a, b)
    skipping = threading.Thread(target=lambda: a.push("c1.0", 0, [PushItem(KEY, np.empty(0, np.float32))],
                                                      skip_step=True))
    skipping.start()
    a.push("c2.0", 0, [PushItem(KEY, grad(3.0))])
    skipping.join(timeout=5)
    assert a.store.get(KEY).version == 0 and a.sync.skipped == 1  # skipped: nothing applied
    b.replication.set_roles(*table(2, 2, 1))  # the primary died; the backup is promoted
    started = time.monotonic()
    again = b.push("c2.0", 0, [PushItem(KEY, grad(3.0))])[0]
    assert time.monotonic() - started < 1.0  # not a wait for the skipping replica's push
    assert not again.applied and b.store.get(KEY).version == 0 and b.sync.dropped == 0
    third = threading.Thread(target=lambda: b.push("c3.0", 1, [PushItem(KEY, grad(1.0))]))
    third.start()
    b.push("c4.0", 1, [PushItem(KEY, grad(1.0))])  # the next step runs on the new primary
    third.join(timeout=5)
    assert b.store.get(KEY).version == 1 and b.store.get(KEY).value[0] == pytest.approx(1.0 - 0.1)


def test_a_skipped_steps_replies_wait_for_its_note_on_the_backup(pair):
    a, b, links = pair
    create(a, "sgd")
    for core in (a, b):
        core.sync.configure("sync", 2, 2, 0)
        core.replication.step_timeout = 3.0
    roles(a, b)
    replies: list = []

    def skip() -> None:
        try:
            replies.append(a.push("c1.0", 0, [PushItem(KEY, np.empty(0, np.float32))], skip_step=True))
        except UnavailableError as exc:
            replies.append(exc)

    skipping = threading.Thread(target=skip)
    skipping.start()
    links[1].cut.set()  # the backup stops answering before the step settles
    with pytest.raises(UnavailableError, match="note of a skipped sync step"):
        a.push("c2.0", 0, [PushItem(KEY, grad(3.0))])  # skipped, but the note is not on the backup
    skipping.join(timeout=10)
    assert isinstance(replies[0], UnavailableError)  # the other replica was not acknowledged either
    links[1].cut.clear()
    assert not a.push("c2.0", 0, [PushItem(KEY, grad(3.0))])[0].applied  # the retry, once the backup holds it
    assert b.store.get(KEY).record.seen("sync:0") and b.store.get(KEY).version == 0


# -- one copy (replicas: 1, elastic): no backup but a move's temporary one --------------------------
def test_one_copy_async_pushes_are_served_inline_until_a_move_gives_the_shard_a_backup(pair):
    from pscluster.server.bulk import BulkHandlers

    a, b, _ = pair
    create(a)
    a.replication.set_roles(*table(1, 1, 0))  # one copy on PS 0
    assert not a.replication.forwards()
    handlers = BulkHandlers(a)
    push = pb.BulkRequest(push=pb.PushRequest(items=[pb.PushItem(ref=pb.ShardRef(variable="w", shard_index=0))]),
                          shm_bytes=16)
    state = {"shm": object()}
    assert handlers.inline(push, state)  # nothing to wait for: on the loop, as with replicas: 1
    a.sync.configure("sync", 2, 2, 0)
    assert not handlers.inline(push, state)  # a sync push waits for its step (other peers' pushes): a thread
    a.sync.configure("async", 1, 1, 0)
    b.replication.set_roles(*table(2, 2, 0, 1))  # a move: PS 1 catches up as a temporary backup
    a.replication.set_roles(*table(2, 2, 0, 1))
    assert a.replication.forwards() and not b.replication.forwards()
    assert not handlers.inline(push, state)  # a push's reply waits for the backup: on a thread
    a.push("c2.0", 0, [PushItem(KEY, grad(0.25))])
    same(a, b, KEY)  # the backup holds it before the reply
    for core in (a, b):
        core.replication.set_roles(*table(3, 3, 1))  # switched: PS 1 the primary, no backup again
    assert not a.replication.forwards() and not b.replication.forwards() and b.replication.is_primary(KEY)


def test_an_update_forwarded_while_a_new_backup_is_set_is_left_to_its_whole_state_never_sent_alone(pair, monkeypatch):
    """set_roles forgot what the backup confirmed, then (a second critical section) marked the shard for its
    whole state: an update forwarded between the two was queued alone, and could be confirmed by an older copy
    the backup kept. Now the shard is marked in the same critical section: the update rides in the state."""
    from pscluster.server.replicator import Replicator

    a, b, _ = pair
    create(a)
    a.replication.set_roles(*table(1, 1, 0))
    between: list[int] = []
    forget = Replicator.forget

    def forget_then_forward(rep, key, epoch, *args, **kwargs):
        forget(rep, key, epoch, *args, **kwargs)
        if key == KEY:  # what a push's forward does right here (`on_applied`, under the shard's lock)
            before = rep.queued
            rep.put(KEY, 1, pb.ReplicaForward(ref=pb.ShardRef(variable="w"), epoch=epoch, version=1,
                                              grad=pb.Tensor()), [grad(1.0)])
            between.append(rep.queued - before)

    monkeypatch.setattr(Replicator, "forget", forget_then_forward)
    b.replication.set_roles(*table(2, 2, 0, 1))
    a.replication.set_roles(*table(2, 2, 0, 1))
    assert between == [0]  # skipped: the whole state, queued after, holds it


def test_two_config_changes_at_once_each_wait_for_the_backup_neither_returns_unconfirmed(pair):
    """Before: one place per shard, popped by the first waiter: the second change's caller found none and returned
    at once, before the backup held its change."""
    a, b, links = pair
    create(a)
    roles(a, b)
    links[1].cut.set()  # the backup does not answer
    shard = a.store.get(KEY)
    for lr in (0.2, 0.3):  # two set_hyperparameters calls on one shard, both queued before either waits
        with shard.lock:
            shard.spec = replace(shard.spec, optimizer=OptimizerConfig("adam", lr))
            a.replication.configured(shard)
    for _ in range(2):
        with pytest.raises(UnavailableError, match="did not confirm a config change"):
            a.replication.wait_configured([KEY], timeout=0.3)
    links[1].cut.clear()
    a.replication.wait_configured([KEY])  # the retry, once the backup holds both
    assert b.store.get(KEY).spec.optimizer == OptimizerConfig("adam", 0.3)
