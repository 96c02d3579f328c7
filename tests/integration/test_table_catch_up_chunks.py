"""A dynamic table's catch-up in chunks (server/catch_up.py `table_chunks`) between two in-process PS cores.

The table's state is many times the chunk size: it reaches the backup as a first chunk (admission filter,
counters, push record) and chunks of keys with their rows, slots and metadata, one batch each, the backup
building the table outside its store until the last one. Pushes, row-creating pulls and an on-demand sweep made while the chunks are on the way follow the last chunk and end
equal on both copies; a link cut halfway leaves the backup with no table counted as held, and the next
catch-up completes it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import table_state as ts
from pscluster.server.ps import ParameterServerCore
from pscluster.server.push_record import push_key
from pscluster.server.replication import Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.optimizers import Adam
from pscluster.tables import Admission, Eviction, TableConfig
from tests.unit.test_replication import Link, make_core
from tests.unit.test_table_replication import DYN, same_table

CHUNK = 4 << 10
BOUND_S = 20.0


class GatedLink(Link):
    """Counts the catch-up chunks and batches sent; batches after the first `after` wait until `gate` is set."""

    def __init__(self, target: ParameterServerCore) -> None:
        super().__init__(target)
        self.after = 1 << 30
        self.gate = threading.Event()
        self.sent: list[pb.ReplicateRequest] = []
        self.nbytes: list[int] = []  # payload bytes of every batch

    def replicate(self, request: pb.ReplicateRequest, arrays: list[np.ndarray], timeout: float) -> pb.ReplicateReply:
        self.sent.append(request)
        self.nbytes.append(sum(a.nbytes for a in arrays))
        if len(self.sent) > self.after:
            self.gate.wait(BOUND_S)
        return super().replicate(request, arrays, timeout)

    def chunks(self) -> int:
        return sum(1 for r in self.sent for f in r.forwards if f.HasField("spec"))


@pytest.fixture
def cores():
    peers: dict[int, ParameterServerCore] = {}
    b = make_core(1, peers, {})
    link = GatedLink(b)
    a = make_core(0, peers, {1: link})
    peers.update({0: a, 1: b})
    a.replication.chunk_bytes = CHUNK
    a.replication.timeout = BOUND_S  # a push's wait for the backup outlasts a gated catch-up on a loaded machine
    yield a, b, link
    link.gate.set()
    a.replication.stop()
    b.replication.stop()


def create(core: ParameterServerCore, cfg: TableConfig) -> None:
    core.create(ShardSpec("dyn", 0, 1, (0, 8), (0, 8), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None, "zeros", 0, 0)


def push(core: ParameterServerCore, pid: str, keys: np.ndarray) -> None:
    core.push(pid, 0, [PushItem(DYN, np.full((keys.size, 8), 0.5, np.float32), keys.astype(np.int64))])


def fill(core: ParameterServerCore, n: int, repeat: int = 1) -> None:
    """One copy while n keys get rows (each pushed `repeat` times: admission counts them)."""
    core.replication.set_roles(1, [Role(DYN, 1, 0)])
    keys = np.arange(n, dtype=np.int64) * 7919 - 1000
    for r in range(repeat):
        for i in range(0, n, 100):
            push(core, f"fill{r}.{i}", keys[i:i + 100])


def expected_chunks(core: ParameterServerCore) -> int:
    """The filter's chunk, then the keys' (as many per chunk as fit CHUNK) of the table's state now."""
    table = core.store.get(DYN).table
    assert table is not None
    state = ts.snapshot(table)
    row_bytes = sum(arr.nbytes for name, arr in state.items() if ts.per_key(name)) // table.live
    return 1 + -(-table.live // (CHUNK // row_bytes))


def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        time.sleep(0.005)


def backup_it(a: ParameterServerCore, b: ParameterServerCore, epoch: int = 2) -> None:
    for core in (b, a):
        core.replication.set_roles(epoch, [Role(DYN, epoch, 0, 1)])


@pytest.mark.parametrize("min_count", [2, 5])
def test_a_sketch_larger_than_a_chunk_reaches_the_backup_in_pieces_no_chunk_over_the_size(cores, min_count):
    """Chunk 0 carried the whole admission filter (16 MiB for a default count-min sketch), so a frame limit
    below it could never carry a catch-up; a table with no key admitted yet (min_count 5) went whole."""
    a, b, link = cores
    cfg = TableConfig(dim=8, capacity=2048, admission=Admission("cms", min_count=min_count, cms_width=4096, cms_depth=2))
    create(a, cfg)
    fill(a, 300, repeat=2)
    table = a.store.get(DYN).table
    assert table is not None and table.live == (300 if min_count == 2 else 0)
    sketch_chunks = -(-(2 * 4096 * 4 + 48) // CHUNK)  # 32 KiB of sketch and the meta
    chunks = sketch_chunks + (expected_chunks(a) - 1 if table.live else 0)
    backup_it(a, b)
    until(lambda: not a.replication.catching_up(), "the catch-up to finish")
    same_table(a, b)  # the sketch (and keys, rows, slots, version) equal on the backup
    assert link.chunks() == chunks and max(link.nbytes) <= CHUNK
    push(a, "after", np.array([5, 10**9], np.int64))  # counted on both: the next occurrence admits alike
    same_table(a, b)


def test_a_table_several_times_the_chunk_size_reaches_its_backup_in_chunks(cores):
    a, b, link = cores
    create(a, TableConfig(dim=8, capacity=2048, admission=Admission("counter", min_count=2)))
    fill(a, 600, repeat=2)
    push(a, "candidates", np.arange(50, dtype=np.int64) + 10**9)  # seen once: admission candidates, no rows
    table = a.store.get(DYN).table
    assert table is not None and table.live == 600
    chunks = expected_chunks(a)
    backup_it(a, b)
    until(lambda: not a.replication.catching_up(), "the catch-up to finish")
    same_table(a, b)  # keys, rows, Adam's slots, metadata, the admission candidates, version
    assert b.store.get(DYN).record.seen_key(push_key("fill1.500")) and b.replication.epoch_of(DYN) == 2
    assert link.chunks() == chunks > 15  # the filter's chunk, then the keys' chunks, each sent once
    assert max(link.nbytes) <= CHUNK  # no batch carries more than a chunk
    assert all(sum(1 for f in r.forwards if f.HasField("spec")) == 1 for r in link.sent)
    push(a, "after", np.array([5, 10**9], np.int64))  # a forward on the installed table
    same_table(a, b)


def test_pushes_pulls_and_a_sweep_that_race_the_catch_up_end_equal_on_both(cores):
    a, b, link = cores
    create(a, TableConfig(dim=8, capacity=700, eviction=Eviction("steps", max_idle=2)))
    fill(a, 600)
    chunks = expected_chunks(a)
    link.after = 3  # the fourth chunk waits at the link: the backup holds three, staged
    backup_it(a, b)
    until(lambda: len(link.sent) >= 4, "the first chunks")
    assert b.store.find(DYN) is None  # staged, not installed
    version = a.store.get(DYN).version
    racing = [threading.Thread(target=push, args=(a, "race0", np.array([1, -1000, 424242], np.int64))),
              threading.Thread(target=push, args=(a, "race1", np.array([-1000, 7, 8], np.int64)))]
    for thread in racing:
        thread.start()
    until(lambda: a.store.get(DYN).version == version + 2, "both pushes applied on the primary")
    a.pull([(DYN, np.arange(200, dtype=np.int64) + 10**6)])  # new rows (a full shard: it evicts for them)
    evicted = a.store.get(DYN).table.stats.evicted
    assert evicted > 0
    swept: list[int] = []
    sweep = threading.Thread(target=lambda: swept.append(a.evict("dyn")))  # rows idle over 2 pushes leave
    sweep.start()
    until(lambda: a.store.get(DYN).table.stats.evicted > evicted, "the sweep on the primary")
    assert b.store.find(DYN) is None  # still staged: what raced waits behind the last chunk
    link.gate.set()
    for thread in (*racing, sweep):
        thread.join(BOUND_S)
    until(lambda: not a.replication.catching_up(), "the catch-up to finish")
    assert swept and swept[0] > 0 and b.store.get(DYN).table.stats.evicted == a.store.get(DYN).table.stats.evicted
    same_table(a, b)
    assert link.chunks() == chunks > 15  # each chunk sent once: no GAP, what raced came after the last


def test_a_link_cut_halfway_leaves_no_table_held_and_the_next_catch_up_completes_it(cores):
    a, b, link = cores
    create(a, TableConfig(dim=8, capacity=2048))
    fill(a, 600)
    link.after = 3
    backup_it(a, b)
    until(lambda: len(link.sent) >= 4, "the first chunks")
    link.cut.set()  # the primary's link dies with half the table staged on the backup
    link.gate.set()
    time.sleep(0.2)  # resends fail meanwhile
    assert b.store.find(DYN) is None and b.replication.epoch_of(DYN) == 0  # nothing of it counts as held
    assert a.replication.catching_up() == [DYN]
    meanwhile = threading.Thread(target=push, args=(a, "meanwhile", np.array([3, 4], np.int64)))
    meanwhile.start()  # applied on the primary; acknowledged once the next catch-up carried it
    until(lambda: a.store.get(DYN).table.lookup(np.array([3, 4], np.int64)).min() >= 0, "the push on the primary")
    link.cut.clear()
    backup_it(a, b, epoch=3)  # the pair again at a new epoch: its catch-up starts from the first chunk
    meanwhile.join(BOUND_S)
    until(lambda: not a.replication.catching_up(), "the second catch-up to finish")
    same_table(a, b)
    assert b.replication.epoch_of(DYN) == 3


def test_a_part_that_repeats_keys_or_is_not_ascending_is_refused_and_changes_nothing():
    from pscluster.server.dynamic_table import DynamicTable

    from pscluster.errors import InvalidArgumentError

    src = DynamicTable(TableConfig(dim=2, capacity=16), Adam(0.1))
    src.push(np.array([1, 2, 3, 4], np.int64), np.ones((4, 2), np.float32))
    state = {name: arr for name, arr in ts.snapshot(src).items() if ts.per_key(name)}
    built = DynamicTable(TableConfig(dim=2, capacity=16), Adam(0.1))
    ts.load_rows(built, {name: arr[:2] for name, arr in state.items()})
    with pytest.raises(InvalidArgumentError, match="repeats keys"):
        ts.load_rows(built, {name: arr[1:3] for name, arr in state.items()})
    with pytest.raises(InvalidArgumentError, match="ascending"):
        ts.load_rows(built, {name: arr[::-1][:2] for name, arr in state.items()})
    assert built.live == 2
    ts.load_rows(built, {name: arr[2:] for name, arr in state.items()})
    ts.load_rest(built, {name: arr for name, arr in ts.snapshot(src).items() if not ts.per_key(name)})
    mine, theirs = ts.snapshot(built), ts.snapshot(src)
    assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)


def test_a_table_over_the_backups_frame_limit_catches_up_over_the_framed_bulk_port():
    """6 MiB of table state against a 1 MiB frame limit: as one message it never got through (resent forever)."""
    from pscluster.server import sync_replicas
    from pscluster.server.bulk import BulkHandlers
    from pscluster.server.replica_links import FrameLink
    from pscluster.server.replication import Replication

    from pscluster.config import ClusterSpec, Settings

    backup = ParameterServerCore(1, 2)
    sync_replicas.attach(backup)
    backup.replication = Replication(backup.store, 1, lambda ps: pytest.fail("the backup forwards nothing"))
    frames = BulkHandlers(backup).server("127.0.0.1", "secret", 1 << 20, max_payload_bytes=1 << 20).start()
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]), token="secret")
    primary = ParameterServerCore(0, 2)
    sync_replicas.attach(primary)
    primary.replication = Replication(primary.store, 0, lambda ps: FrameLink(
        settings.cluster.ps[ps], settings, port_of=lambda timeout: frames.port), timeout=BOUND_S, chunk_bytes=256 << 10)
    try:
        cfg = TableConfig(dim=32, capacity=20000)
        primary.create(ShardSpec("dyn", 0, 1, (0, 32), (0, 32), 0, "<f4", Adam(0.1), True, 0, cfg.to_json()), None,
                       "zeros", 0, 0)
        primary.replication.set_roles(1, [Role(DYN, 1, 0)])
        keys = np.arange(16000, dtype=np.int64) * 31
        for i in range(0, keys.size, 4000):
            primary.push(f"fill{i}", 0, [PushItem(DYN, np.full((4000, 32), 0.25, np.float32), keys[i:i + 4000])])
        table = primary.store.get(DYN).table
        assert table is not None and sum(a.nbytes for a in ts.snapshot(table).values()) > 6 << 20
        for core in (backup, primary):
            core.replication.set_roles(2, [Role(DYN, 2, 0, 1)])
        until(lambda: not primary.replication.catching_up(), "the catch-up to finish")
        same_table(primary, backup)
        primary.push("after", 0, [PushItem(DYN, np.ones((2, 32), np.float32), np.array([31, 5], np.int64))])
        same_table(primary, backup)
    finally:
        primary.replication.stop()
        backup.replication.stop()
        frames.stop()


def test_a_forward_that_reaches_a_staged_table_answers_gap_and_a_bad_chunk_changes_nothing():
    from pscluster.server import catch_up

    from pscluster import codec
    from pscluster.errors import InvalidArgumentError
    from pscluster.specs import spec_to_pb

    peers: dict[int, ParameterServerCore] = {}
    a, b = make_core(0, peers, {}), make_core(1, peers, {})
    try:
        create(a, TableConfig(dim=8, capacity=2048))
        fill(a, 300)
        shard = a.store.get(DYN)
        assert shard.table is not None
        base = pb.ReplicaForward(ref=pb.ShardRef(variable="dyn", shard_index=0), epoch=2, version=shard.version,
                                 spec=spec_to_pb(shard.spec))
        chunks = catch_up.table_chunks(shard, ts.snapshot(shard.table), CHUNK, base)
        assert len(chunks) > 5
        b.replication.set_roles(2, [Role(DYN, 2, 0, 1)])

        def send(msg: pb.ReplicaForward, arrays: list[np.ndarray]) -> int:
            return b.replication.receive(pb.ReplicateRequest(forwards=[msg]), arrays).outcomes[0]

        assert send(*chunks[0]) == pb.REPLICA_APPLIED and send(*chunks[1]) == pb.REPLICA_APPLIED
        keys = np.array([1], np.int64)
        update = pb.ReplicaForward(ref=base.ref, epoch=2, version=shard.version, has_rows=True, pulled=True,
                                   rows=codec.header(keys.dtype, keys.shape))  # a pull that made a row
        assert send(update, [keys]) == pb.REPLICA_GAP  # out of order: never applied to half a table
        assert send(*chunks[3]) == pb.REPLICA_GAP  # a chunk beyond the next
        bad, arrays = chunks[2]
        with pytest.raises(InvalidArgumentError, match="ascending"):
            send(bad, [arrays[0]] + [arr[::-1] for arr in arrays[1:]])
        for msg, arrays in chunks[2:]:  # the right chunk 2 and the rest: nothing of the refused one stayed
            assert send(msg, arrays) == pb.REPLICA_APPLIED
        same_table(a, b)
    finally:
        a.replication.stop()
        b.replication.stop()


def test_a_series_larger_than_the_queue_room_is_not_restarted_by_the_pulls_that_race_it(cores):
    """A table's chunks may overfill the replication queue once (a 500 MiB table against 256 MiB of room);
    an update racing them was refused room, so its shard went dirty and the catch-up started over from a new
    snapshot, again for every update: 798 chunks were sent in 8 s for a 42-chunk table and it never ended."""
    a, b, link = cores
    create(a, TableConfig(dim=8, capacity=2048))
    fill(a, 1500)
    chunks = expected_chunks(a)
    link.after = 1  # the first chunk goes; the rest wait while pulls make rows (their forwards queue behind)
    backup_it(a, b)
    until(lambda: 1 in a.replication._replicators, "the replicator")
    a.replication._replicators[1]._max_queued = 16 << 10  # the series is several times the room
    until(lambda: link.chunks() >= 1, "the first chunk")
    for i in range(20):
        a.pull([(DYN, np.array([10**7 + i], np.int64))])  # row-creating pulls: their replies wait for nothing
    link.gate.set()
    until(lambda: not a.replication.catching_up(), "the catch-up's end")
    push(a, "after", np.array([1, 2], np.int64))
    same_table(a, b)
    assert link.chunks() == chunks, (link.chunks(), chunks)  # one series: not restarted by the pulls


def test_a_sweep_skipped_while_its_shard_is_resent_reaches_the_backup_with_the_state(cores):
    """An on-demand sweep's forward is skipped while its shard's whole state is on the way (the state holds it);
    the backup, already at that version, answered the state 'held' (same stream, same version) and kept the
    swept keys, though Evict returned: a state at the same version is held only with its pulls and sweeps."""
    a, b, link = cores
    create(a, TableConfig(dim=8, capacity=700, eviction=Eviction("steps", max_idle=2)))
    fill(a, 50)
    backup_it(a, b)
    until(lambda: not a.replication.catching_up(), "the catch-up")
    for pid in ("x1", "x2", "x3"):
        push(a, pid, np.array([1, 2], np.int64))
    version = a.store.get(DYN).version
    until(lambda: b.store.get(DYN).version == version, "the backup at the primary's version")
    rep = a.replication._replicators[1]
    shard = a.store.get(DYN)
    with shard.lock:
        with rep._cond:
            rep._dirty.add(DYN)  # as after a refused update or a GAP: the next whole state carries what follows
        assert shard.table is not None
        gone = shard.table.sweep().evicted
        a.replication.swept(shard, gone)  # what table_ops.sweep does under the lock
    a.replication.wait_configured([DYN])  # Evict's wait
    assert gone.size == 50  # every filled key: only 1 and 2 were pushed since
    same_table(a, b)
