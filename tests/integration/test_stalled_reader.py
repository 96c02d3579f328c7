"""Peers that stop reading, answering or sending mid-transfer (a SIGSTOPped worker or PS): real sockets, in-process PS.

The stalled reader is a raw socket that asks for a large dense pull and then never calls recv. The
test waits for a *state* (the reader's receive buffer holds the first bytes of the payload, so the PS
is inside the pull's send loop with the kernel buffers filling up), never for a duration.
"""

import fcntl
import socket
import struct
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, ShardSpec

from pscluster.errors import UnavailableError
from pscluster.net.bulk import BulkCall, BulkClient
from pscluster.net.framing import PREFIX

ROWS, COLS = 4096, 4096  # one 64 MiB float32 shard: 16 send chunks, far beyond any socket buffer
BOUND_S = 20.0  # upper bound on waiting for a condition; a healthy run needs milliseconds


def _core() -> ParameterServerCore:
    core = ParameterServerCore(0, 1)
    core.create(ShardSpec("big", 0, 1, (ROWS, COLS), (ROWS, COLS), 0, "<f4", OptimizerConfig("sgd", 1.0)),
                None, "zeros", 0.0, 0)
    return core


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {BOUND_S} s: {what}"
        threading.Event().wait(0.005)  # a polling interval between checks of a state, not a synchronisation


def _unread(sock: socket.socket) -> int:
    buf = fcntl.ioctl(sock, termios.FIONREAD, struct.pack("i", 0))
    return int(struct.unpack("i", buf)[0])


def _stalled_pull(port: int) -> socket.socket:
    """A connection that requests the whole shard and then reads nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connect: a small window
    sock.settimeout(BOUND_S)
    sock.connect(("127.0.0.1", port))
    header = pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="big"))]))
    raw = header.SerializeToString()
    sock.sendall(PREFIX.pack(len(raw), 0) + raw)
    # The reply's prefix, header and payload bytes pile up unread: the PS is sending the payload now.
    _wait_until(lambda: _unread(sock) > PREFIX.size + 64, "the PS has started sending the payload")
    return sock


def _finishes(fn, threads: list) -> bool:
    """Run fn in a thread (joined by the caller); True if it returned within the bound."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (fn(), done.set()), name="test-op")
    threads.append(thread)
    thread.start()
    return done.wait(BOUND_S)


def test_push_and_checkpoint_complete_while_a_reader_stalls_mid_pull():
    core = _core()
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 20).start()  # default io timeout (30 s)
    reader = None
    threads: list = []
    try:
        reader = _stalled_pull(frames.port)
        grad = np.ones((ROWS, COLS), np.float32)
        assert _finishes(lambda: core.push("p1", 0, [PushItem(("big", 0), grad)]), threads), \
            "a push to the shard waited behind the stalled reader"
        frozen_ok = []

        def checkpoint_view():
            with core.store.frozen() as shards:
                frozen_ok.append(shards[0].version)

        assert _finishes(checkpoint_view, threads), "frozen() (a checkpoint) waited behind the stalled reader"
        assert frozen_ok == [1]
        assert core.store.get(("big", 0)).value[0, 0] == -1.0
    finally:
        if reader is not None:
            reader.close()  # releases the old code's lock too, so the other threads end
        frames.stop()
        for thread in threads:
            thread.join(BOUND_S)


def test_a_stalled_reader_loses_its_connection_and_others_still_pull():
    core = _core()
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 20, io_timeout_s=0.5).start()
    pool = ThreadPoolExecutor(2)
    client = BulkClient(["127.0.0.1"], lambda ps: frames.port, None, timeout=5.0, pool=pool, io_timeout=BOUND_S)
    reader = None
    try:
        reader = _stalled_pull(frames.port)
        # The PS's send times out and it closes the connection: its thread and buffer are freed.
        _wait_until(lambda: frames.connections == 0, "the PS closed the stalled connection")
        received = 0
        while True:
            try:
                got = reader.recv(1 << 20)
            except ConnectionResetError:
                break
            if not got:
                break
            received += len(got)
        assert received < ROWS * COLS * 4  # the reader got a truncated reply, then EOF or a reset
        core.push("p1", 0, [PushItem(("big", 0), np.full((ROWS, COLS), 2.0, np.float32))])
        out = np.empty((ROWS, COLS), np.float32)
        call = BulkCall(0, pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="big"))])),
                        targets=[out])
        client.run([call])
        assert list(call.reply.pull.versions) == [1]
        np.testing.assert_array_equal(out, np.full((ROWS, COLS), -2.0, np.float32))
    finally:
        if reader is not None:
            reader.close()
        client.close()
        pool.shutdown()
        frames.stop()


def test_a_ps_that_stops_answering_gives_the_puller_a_retryable_error():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []

    def silent_ps():  # reads the request, never answers (a SIGSTOPped PS with its kernel still accepting)
        conn, _ = listener.accept()
        accepted.append(conn)

    acceptor = threading.Thread(target=silent_ps, name="test-silent-ps")
    acceptor.start()
    pool = ThreadPoolExecutor(2)
    client = BulkClient(["127.0.0.1"], lambda ps: port, None, timeout=5.0, pool=pool, io_timeout=0.5)
    try:
        out = np.empty(4, np.float32)
        call = BulkCall(0, pb.BulkRequest(pull=pb.PullRequest(items=[pb.PullItem(ref=pb.ShardRef(variable="v"))])),
                        targets=[out])
        with pytest.raises(UnavailableError) as info:
            client.run([call])
        assert info.value.retryable
        assert "timed out" in str(info.value)
    finally:
        client.close()
        pool.shutdown()
        acceptor.join(timeout=BOUND_S)
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_pusher_that_stops_mid_payload_loses_its_connection_and_changes_nothing():
    core = _core()
    frames = BulkHandlers(core).server("127.0.0.1", None, 1 << 20, io_timeout_s=0.5).start()
    sock = socket.create_connection(("127.0.0.1", frames.port), timeout=BOUND_S)
    try:
        item = pb.PushItem(ref=pb.ShardRef(variable="big"),
                           grad=pb.Tensor(dtype="<f4", shape=[ROWS, COLS]))
        raw = pb.BulkRequest(push=pb.PushRequest(items=[item], push_id="half")).SerializeToString()
        nbytes = ROWS * COLS * 4
        sock.sendall(PREFIX.pack(len(raw), nbytes) + raw + b"\x00" * (nbytes // 2))  # then nothing more
        _wait_until(lambda: frames.connections == 0, "the PS closed the stalled push connection")
        shard = core.store.get(("big", 0))
        assert shard.version == 0 and len(shard.record) == 0
        assert not shard.value.any()
    finally:
        sock.close()
        frames.stop()


def test_a_push_to_a_silent_ps_the_replica_table_moved_its_shard_off_ends_at_the_next_check():
    """replicas: 2: a SIGSTOPped primary is replaced in ~0.4 s; its pushers give up then, not after io_timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []

    def silent_ps():
        conn, _ = listener.accept()
        accepted.append(conn)

    acceptor = threading.Thread(target=silent_ps, name="test-silent-ps")
    acceptor.start()
    asked = []

    def stalled(ps, request):  # the replica table: the shard moved once the primary was silent for 2 checks
        asked.append(ps)
        return len(asked) >= 2 and request.HasField("push")

    pool = ThreadPoolExecutor(2)
    client = BulkClient(["127.0.0.1"], lambda ps: port, None, timeout=5.0, pool=pool, io_timeout=BOUND_S,
                        stalled=stalled, check_s=0.05)
    try:
        grad = np.ones(4, np.float32)
        push = pb.PushRequest(items=[pb.PushItem(ref=pb.ShardRef(variable="v"))], push_id="p1")
        started = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            client.run([BulkCall(0, pb.BulkRequest(push=push), payloads=[grad])])
        assert time.monotonic() - started < BOUND_S / 4  # the io timeout (BOUND_S) was not waited for
        assert info.value.retryable and "replica table" in str(info.value)
        assert asked == [0, 0]
    finally:
        client.close()
        pool.shutdown()
        acceptor.join(timeout=BOUND_S)
        for conn in accepted:
            conn.close()
        listener.close()
