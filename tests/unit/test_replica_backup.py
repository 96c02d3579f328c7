"""The backup's side of replication (server/replica_backup.py `receive`) when a batch arrives twice.

A batch whose reply was lost is resent (on a new connection it may even overlap the first copy): the
backup must hold what it applied already, whatever the batch carries. Each test replays batches the
primary sent, as the wire carried them, and failed on the code before its fix (found by review).
"""

from __future__ import annotations

import threading
import time

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.replica_links import payload_views
from pscluster.server.store import PushItem, ShardSpec

from pscluster.optimizers import Adam
from pscluster.tables import TableConfig
from tests.unit.test_replication import KEY, create, grad, pair, roles, same  # noqa: F401 - pair: the fixture
from tests.unit.test_table_replication import DYN, same_table, set_roles

BOUND_S = 10.0


def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        threading.Event().wait(0.01)  # a polling interval between checks of a state


def recording(link) -> list[tuple[bytes, np.ndarray]]:
    """Every batch the link carries from now on and the backup answered, as the wire carried it (header, payload)."""
    sent: list[tuple[bytes, np.ndarray]] = []
    plain = link.replicate

    def replicate(request, arrays, timeout):
        payload = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]) \
            if arrays else np.empty(0, np.uint8)
        reply = plain(request, arrays, timeout)
        sent.append((request.SerializeToString(), payload))  # once the backup took it
        return reply

    link.replicate = replicate
    return sent


def replay(core, batch: tuple[bytes, np.ndarray]) -> pb.ReplicateReply:
    request = pb.ReplicateRequest.FromString(batch[0])
    return core.replication.receive(request, payload_views(request, batch[1].copy()), owned=True)


def test_a_resent_catch_up_does_not_roll_the_backup_back_over_the_updates_after_it(pair):
    a, b, links = pair
    create(a)
    roles(a, b)
    sent = recording(links[1])
    a.replication.resync(KEY)  # a catch-up of the shard's whole state, as after a GAP

    def installs() -> list[tuple[bytes, np.ndarray]]:
        return [batch for batch in sent if any(f.HasField("spec") for f in pb.ReplicateRequest.FromString(batch[0])
                                               .forwards)]

    until(lambda: installs(), "the catch-up's batch")
    a.push("c1.0", 0, [PushItem(KEY, grad(1.0))])
    a.push("c2.0", 0, [PushItem(KEY, grad(2.0))])  # acknowledged: the backup holds version 2
    reply = replay(b, installs()[0])  # the catch-up's batch again (its first reply was lost)
    assert all(outcome == pb.REPLICA_APPLIED for outcome in reply.outcomes)
    same(a, b, KEY)  # version 2 on both: before, the backup went back to version 0 and lost both updates
    a.push("c3.0", 0, [PushItem(KEY, grad(3.0))])
    same(a, b, KEY)


def test_a_resent_pull_at_the_same_version_does_not_re_create_rows_a_later_pull_evicted(pair):
    a, b, links = pair
    cfg = TableConfig(dim=2, capacity=4, initializer="uniform", init_value=0.1)  # admission "always": pulls create
    a.create(ShardSpec("dyn", 0, 1, (0, 2), (0, 2), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)
    for core in (b, a):
        set_roles(core)
    a.replication.wait([(DYN, a.store.get(DYN).version)])
    a.push("c1.0", 0, [PushItem(DYN, np.ones((2, 2), np.float32), np.array([1, 2], np.int64))])
    sent = recording(links[1])
    a.pull([(DYN, np.array([3, 4], np.int64))])  # fills the shard
    a.pull([(DYN, np.array([5, 6, 7], np.int64))])  # evicts 3 rows for its own, at the same version
    # no push waits for them: the thread sends them
    until(lambda: sum(len(pb.ReplicateRequest.FromString(h).forwards) for h, _ in sent) >= 2, "the pulls' forwards")
    same_table(a, b)
    for batch in list(sent):
        replay(b, batch)  # the pulls' batches again: a resend after a lost reply
    same_table(a, b)  # before: the first pull ran again on the backup and brought back rows 3 and 4
    a.push("c2.0", 0, [PushItem(DYN, np.ones((1, 2), np.float32), np.array([5], np.int64))])
    same_table(a, b)


def _first_chunk(a, epoch: int) -> tuple[pb.ReplicaForward, list[np.ndarray]]:
    """The first chunk of a catch-up of a's (16, 4) Adam shard "big"[0] in 4 chunks, at `epoch`."""
    from pscluster.server import catch_up

    from pscluster.specs import spec_to_pb

    shard = a.store.get(("big", 0))
    msg = pb.ReplicaForward(ref=pb.ShardRef(variable="big", shard_index=0), epoch=epoch, version=shard.version,
                            spec=spec_to_pb(shard.spec))
    return msg, catch_up.chunk(shard, 0, 4, msg)


def test_a_half_staged_catch_up_is_dropped_when_the_roles_change_not_kept_until_the_next_one(pair):
    from pscluster.server.optimizers import OptimizerConfig
    from pscluster.server.replication import Role

    a, b, _ = pair
    big = ("big", 0)
    a.create(ShardSpec("big", 0, 1, (16, 4), (16, 4), 0, "<f4", OptimizerConfig("adam", 0.1)), None, "ones", 0, 0)
    b.replication.set_roles(1, [Role(big, 1, 0, 1)])  # a move: PS 1 the temporary backup
    msg, arrays = _first_chunk(a, 1)
    assert b.replication.receive(pb.ReplicateRequest(forwards=[msg]), arrays).outcomes == [pb.REPLICA_APPLIED]
    assert b.replication.staging() == [big]  # 16 rows staged, 4 filled
    b.replication.set_roles(2, [Role(big, 1, 0, 1), Role(KEY, 2, 0)])  # another shard's change: kept
    assert b.replication.staging() == [big]
    b.replication.set_roles(3, [Role(big, 3, 0, 1)])  # a new epoch: its catch-up starts from chunk 0 again
    assert b.replication.staging() == []
    msg, arrays = _first_chunk(a, 3)
    b.replication.receive(pb.ReplicateRequest(forwards=[msg]), arrays)
    assert b.replication.staging() == [big]
    b.replication.set_roles(4, [Role(big, 4, 0)])  # the move aborted: one copy on PS 0, nothing more comes
    assert b.replication.staging() == [] and b.store.find(big) is None
