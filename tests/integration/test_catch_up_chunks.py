"""A catch-up in chunks (server/catch_up.py) over a backup's real framed bulk port.

The shard's state (value and Adam's two slots, 6 MiB) is six times the backup's frame limit (max_tensor_bytes
= 1 MiB, which the value alone exceeds): it reaches the backup in 256 KiB chunks, a sparse and a dense update
made between two chunks reach the staged rows, no batch carries more than a chunk and the updates beside it
(the primary holds one chunk, not a copy of the shard), and the backup ends as the primary's exact copy, push
record included. A catch-up restarted halfway (a new epoch) starts again from its first chunk.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from pscluster.server import sync_replicas
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.push_record import push_key
from pscluster.server.replica_links import FrameLink
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.config import ClusterSpec, Settings

KEY = ("w", 0)
SHAPE = (512, 1024)  # 2 MiB of float32 per array; 6 MiB of state with Adam
LIMIT = 1 << 20  # the backup's frame payload limit (max_tensor_bytes)
CHUNK = 256 << 10
BOUND_S = 20.0


class Gate:
    """Batches after the first `after` wait at the link until `open` is set."""

    def __init__(self) -> None:
        self.after = 1 << 30
        self.open = threading.Event()


@pytest.fixture
def pair():
    backup = ParameterServerCore(1, 2)
    sync_replicas.attach(backup)
    backup.replication = Replication(backup.store, 1, lambda ps: pytest.fail("the backup forwards nothing"))
    frames = BulkHandlers(backup).server("127.0.0.1", "secret", 1 << 20, max_payload_bytes=LIMIT).start()
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]), token="secret")
    batches: list[int] = []  # payload bytes of every batch sent
    chunks: list[int] = []  # chunk forwards (they carry the spec) in every batch sent
    gate = Gate()

    def connect(ps: int) -> FrameLink:
        link = FrameLink(settings.cluster.ps[ps], settings, port_of=lambda timeout: frames.port)
        plain = link.replicate

        def replicate(request, arrays, timeout):
            batches.append(sum(a.nbytes for a in arrays))
            chunks.append(sum(1 for f in request.forwards if f.HasField("spec")))
            if len(batches) > gate.after:
                gate.open.wait(BOUND_S)
            return plain(request, arrays, timeout)

        link.replicate = replicate  # type: ignore[method-assign]
        return link

    primary = ParameterServerCore(0, 2)
    sync_replicas.attach(primary)
    primary.replication = Replication(primary.store, 0, connect, timeout=10.0, chunk_bytes=CHUNK)
    spec = ShardSpec("w", 0, 1, SHAPE, SHAPE, 0, "<f4", OptimizerConfig("adam", 0.01))
    primary.create(spec, np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE), "zeros", 0, 0)
    yield primary, backup, batches, gate, chunks
    gate.open.set()
    primary.replication.stop()
    backup.replication.stop()
    frames.stop()


def same(a: ParameterServerCore, b: ParameterServerCore) -> None:
    sa, sb = a.store.get(KEY), b.store.get(KEY)
    assert sa.version == sb.version
    np.testing.assert_array_equal(sa.value, sb.value)
    assert sa.slots.keys() == sb.slots.keys()
    for name in sa.slots:
        np.testing.assert_array_equal(sa.slots[name], sb.slots[name])


def rows_push(primary: ParameterServerCore, pid: str, rng: np.random.Generator) -> None:
    ids = rng.integers(0, SHAPE[0], 8)
    primary.push(pid, 0, [PushItem(KEY, rng.standard_normal((8, SHAPE[1])).astype(np.float32), ids)])


def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        time.sleep(0.005)


def caught_up(primary: ParameterServerCore) -> None:
    until(lambda: not primary.replication.catching_up(), "the catch-up to finish")


def test_a_shard_over_the_frame_limit_catches_up_in_chunks_with_updates_between_them(pair):
    primary, backup, batches, gate, chunks = pair
    rng = np.random.default_rng(0)
    primary.replication.set_roles(1, [Role(KEY, 1, 0)])  # one copy first
    for i in range(3):  # Adam's slots hold something before the catch-up
        primary.push(f"warm{i}", 0, [PushItem(KEY, rng.standard_normal(SHAPE).astype(np.float32) * 0.01)])
    gate.after = 3  # the fourth chunk waits at the link: updates are made meanwhile
    for core in (backup, primary):
        core.replication.set_roles(2, [Role(KEY, 2, 0, 1)])  # a backup: it catches up
    until(lambda: len(batches) >= 4, "the first chunks")
    version = primary.store.get(KEY).version
    # rows only: a dense gradient of this shard is over the frame limit (a client could not send one either)
    pushes = [threading.Thread(target=rows_push, args=(primary, pid, np.random.default_rng(i)), name=f"test-{pid}")
              for i, pid in enumerate(("rows", "more rows"))]
    for thread in pushes:
        thread.start()
    until(lambda: primary.store.get(KEY).version == version + 2, "both updates applied on the primary")
    gate.open.set()  # they travel after the fourth chunk: the staged rows take them, the later chunks hold them
    for thread in pushes:
        thread.join(BOUND_S)  # acknowledged once the last chunk landed
    caught_up(primary)
    same(primary, backup)
    record = backup.store.get(KEY).record
    assert all(record.seen_key(push_key(pid)) for pid in ("warm0", "warm2", "rows", "more rows"))
    rows = CHUNK // (3 * SHAPE[1] * 4)  # 21 rows of value and two slots per 256 KiB chunk
    # 25 chunks, each sent once (a row update may travel in a batch of its own between two of them)
    assert sum(chunks) == -(-SHAPE[0] // rows) and len(batches) <= sum(chunks) + 2
    assert max(batches) <= CHUNK + 2 * 8 * SHAPE[1] * 4  # a chunk and the row updates beside it, never the shard
    rows_push(primary, "after", rng)
    same(primary, backup)


def test_a_dense_update_between_two_chunks_reaches_the_staged_rows():
    from tests.unit.test_replication import make_core

    peers: dict[int, ParameterServerCore] = {}
    links: dict = {}
    a, b = make_core(0, peers, links), make_core(1, peers, links)
    peers.update({0: a, 1: b})
    try:
        a.replication.chunk_bytes = 3 * 4 * 4 * 4  # 4 rows of (4, 4) float32 with Adam: 16 rows in 4 chunks
        a.create(ShardSpec("w", 0, 1, (16, 4), (16, 4), 0, "<f4", OptimizerConfig("adam", 0.1)), None, "ones", 0, 0)
        a.replication.set_roles(1, [Role(KEY, 1, 0)])
        a.push("warm", 0, [PushItem(KEY, np.full((16, 4), 0.3, np.float32))])
        gate = threading.Event()
        for core in (b, a):
            core.replication.set_roles(2, [Role(KEY, 2, 0, 1)])
        link = links[1]
        plain, sent = link.replicate, []

        def replicate(request, arrays, timeout):
            sent.append(request)
            if len(sent) == 2:
                gate.wait(BOUND_S)  # the second chunk waits: a dense and a sparse update are made meanwhile
            return plain(request, arrays, timeout)

        link.replicate = replicate
        a.replication.resync(KEY)  # the catch-up again, through the gated link
        until(lambda: len(sent) >= 2, "two chunks")
        version = a.store.get(KEY).version
        pushes = [threading.Thread(target=a.push, args=("dense", 0, [PushItem(KEY, np.full((16, 4), 0.5, np.float32))])),
                  threading.Thread(target=a.push, args=("rows", 0, [PushItem(KEY, np.ones((3, 4), np.float32),
                                                                             np.array([1, 9, 15], np.int64))]))]
        for thread in pushes:
            thread.start()
        until(lambda: a.store.get(KEY).version == version + 2, "both updates applied on the primary")
        gate.set()
        for thread in pushes:
            thread.join(BOUND_S)
        caught_up(a)
        same(a, b)
        assert sum(1 for r in sent for f in r.forwards if f.HasField("spec")) >= 4  # it went in chunks
    finally:
        gate.set()
        a.replication.stop()
        b.replication.stop()


def test_a_catch_up_restarted_by_a_new_epoch_starts_again_from_its_first_chunk(pair):
    primary, backup, batches, gate, _ = pair
    gate.after = 3  # the fourth chunk waits at the link: the backup staged three
    for core in (backup, primary):
        core.replication.set_roles(1, [Role(KEY, 1, 0, 1)])
    until(lambda: len(batches) >= 4, "the first chunks")
    assert backup.store.find(KEY) is None  # staged, not installed
    for core in (backup, primary):
        core.replication.set_roles(2, [Role(KEY, 2, 0, 1)])  # the chunk in flight is of the old epoch
    gate.open.set()
    caught_up(primary)
    primary.push("last", 0, [PushItem(KEY, np.ones(SHAPE, np.float32))])
    same(primary, backup)
    assert len(batches) >= 4 + 24  # the new epoch's catch-up sent every chunk again
