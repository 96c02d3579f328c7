"""The client side of the bulk tensor path (see server/bulk.py): pooled TCP connections per PS task.

A request to several PS tasks is pipelined: every request is sent before any reply is read, so the
PS tasks work in parallel without extra threads; transfers above `THREADED_BYTES` use one thread per
PS so the sends themselves overlap. Any socket failure closes the connection and surfaces as
UnavailableError, which callers retry (pushes carry ids, so a retry never applies twice). Every send
and receive is bounded by `io_timeout` (a PS that stops answering mid-transfer is a failure, not a
hang), plus a call's own `wait_s` while the PS may hold the reply on purpose (a token wait).
"""

from __future__ import annotations

import io
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from pscluster.errors import InternalError, UnavailableError, from_status
from pscluster.net import shm
from pscluster.net.framing import PREFIX, STATUS_BY_VALUE, connect, send_buffer, send_hello
from pscluster.net.shm import Segment
from pscluster.net.transport import PullPlan, PushPlan, ValueTargets
from pscluster.proto import pscluster_pb2 as pb

THREADED_BYTES = 2 << 20
COALESCE_BYTES = 64 << 10  # payloads up to this size are copied into the send of the frame's head
READ_BUFFER_BYTES = 64 << 10  # per connection; larger payloads are read straight into their targets
MAX_HEADER_BYTES = 64 << 20  # a reply header larger than this is a broken stream, not a reply
# with a `stalled` hook (replicas: 2), how often a call whose reply has not begun asks whether its PS is still
# the primary of its shards (a table refresh): a SIGSTOPped primary is replaced in ~0.3 s; without it the
# call waits io_timeout
STALL_CHECK_S = 0.1


@dataclass
class BulkCall:
    """One request to one PS: the header, payload buffers to send, and where reply tensors go."""

    ps: int
    request: pb.BulkRequest
    payloads: Sequence[np.ndarray] = ()
    targets: Sequence[np.ndarray] = ()  # pull: C-contiguous arrays to receive into, in item order
    wait_s: float = 0.0  # how long the PS may hold the reply on purpose (added to the io timeout)
    reply: pb.BulkReply | None = field(default=None)
    payload_bytes: int = field(init=False)  # summed once here, not at each step of the call
    target_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.payload_bytes = sum([p.nbytes for p in self.payloads])
        self.target_bytes = sum([t.nbytes for t in self.targets])

    @property
    def nbytes(self) -> int:
        """Bytes this call moves in either direction."""
        return self.payload_bytes + self.target_bytes


class _Conn:
    """A pooled connection to one PS: its socket and, on the same host, its shared-memory segment."""

    def __init__(self, sock: socket.socket, local: bool) -> None:
        self.sock = sock
        # every read goes through this buffer: a reply's prefix and header (and a small payload) arrive in
        # one recv, and the loops that fill a buffer run in C (the socket's timeout still bounds each recv)
        self.reader = cast(io.BufferedReader, sock.makefile("rb", buffering=READ_BUFFER_BYTES))
        self.fresh = True  # the hello is not sent yet
        self.local = local  # may offer the PS a segment (pscluster/net/shm.py)
        self.segment: Segment | None = None

    def read(self, n: int) -> bytes:
        """Exactly n bytes (at most MAX_HEADER_BYTES at once), or ConnectionError at EOF."""
        if n > MAX_HEADER_BYTES:
            raise ConnectionError(f"a PS announced a {n}-byte reply header")
        data = self.reader.read(n)
        if len(data) != n:
            raise ConnectionError("connection closed")
        return data

    def read_into(self, target: np.ndarray) -> None:
        """Fill target (C-contiguous) with the next bytes, or ConnectionError at EOF."""
        view = target.reshape(-1).view(np.uint8).data
        if self.reader.readinto(view) != len(view):
            raise ConnectionError("connection closed")

    def skip(self, n: int) -> None:
        """Read and drop n bytes, a buffer's worth at a time (memory follows the bytes, not the n announced)."""
        while n > 0:
            piece = self.reader.read(min(n, READ_BUFFER_BYTES))
            if not piece:
                raise ConnectionError("connection closed")
            n -= len(piece)

    def read_reply(self) -> tuple[pb.BulkReply, int]:
        """The next reply header and the length of the payload that follows it."""
        header_len, payload_len = PREFIX.unpack(self.read(PREFIX.size))
        reply = pb.BulkReply()
        reply.ParseFromString(self.read(header_len))
        return reply, payload_len

    def close(self) -> None:
        """Close the socket and unmap the segment."""
        self.reader.close()
        self.sock.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class BulkClient:
    """Connection pools to the bulk ports of every PS task."""

    def __init__(self, hosts: Sequence[str], port_of: Callable[[int], int], token: str | None,
                 timeout: float, pool: ThreadPoolExecutor, io_timeout: float = 30.0,
                 tls_context: ssl.SSLContext | None = None, shared_memory: bool = True,
                 stalled: Callable[[int, pb.BulkRequest], bool] | None = None,
                 check_s: float = STALL_CHECK_S) -> None:
        """port_of(ps): PS ps's bulk port, asked (one attempt) when a connection is first needed;
        stalled(ps, request): whether to give up a call whose reply has not begun after check_s (asked again
        every check_s; True: its PS no longer serves the request's shards)."""
        self._stalled = stalled
        self._check_s = check_s
        self._hosts = list(hosts)
        self._port_of = port_of
        self._token = token or ""
        self._timeout = timeout  # connect
        self._io_timeout = io_timeout
        self._pool = pool
        self._tls = tls_context
        # TLS means the bytes were asked to go through TLS: no segment then
        self._shared_memory = shared_memory and tls_context is None and shm.available()
        self._free: list[list[_Conn]] = [[] for _ in hosts]
        self._ports: list[int | None] = [None] * len(hosts)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close every pooled connection."""
        with self._lock:
            for conns in self._free:
                for conn in conns:
                    conn.close()
                conns.clear()

    def moved(self, ps: int, host: str) -> None:
        """PS ps now runs on host (or joined the PS list: ps is the next index): forget its port and pooled
        connections."""
        with self._lock:
            if ps == len(self._hosts):
                self._hosts.append(host)
                self._ports.append(None)
                self._free.append([])
            self._hosts[ps] = host
            self._ports[ps] = None
            stale, self._free[ps] = self._free[ps], []
        for conn in stale:
            conn.close()

    def _acquire(self, ps: int) -> _Conn:
        with self._lock:
            if self._free[ps]:
                return self._free[ps].pop()
            port = self._ports[ps]
        if port is None:
            port = self._port_of(ps)
            if not port:
                raise UnavailableError(f"ps {ps} serves no bulk port")
            with self._lock:
                self._ports[ps] = port
        try:
            sock = connect(self._hosts[ps], port, self._timeout, self._tls)
        except OSError as exc:
            with self._lock:
                self._ports[ps] = None  # a restarted PS listens on a new port
            raise UnavailableError(f"ps {ps} bulk port {self._hosts[ps]}:{port}: {exc}") from exc
        return _Conn(sock, self._shared_memory and shm.is_local_peer(sock))

    def _release(self, ps: int, conn: _Conn) -> None:
        with self._lock:
            self._free[ps].append(conn)

    def _fail(self, ps: int, conn: _Conn, exc: BaseException) -> UnavailableError:
        conn.close()
        with self._lock:
            self._ports[ps] = None
            for c in self._free[ps]:
                c.close()
            self._free[ps].clear()
        return UnavailableError(f"ps {ps} ({self._hosts[ps]}) bulk connection failed: {exc}")

    def _segment(self, conn: _Conn, nbytes: int) -> Segment | None:
        """conn's segment if nbytes fit in it; a new one if they do not and a segment is worth it here."""
        if conn.segment is not None and nbytes <= conn.segment.capacity:
            return conn.segment
        if not conn.local or not shm.MIN_BYTES <= nbytes <= shm.MAX_BYTES:
            return None
        if conn.segment is not None:
            conn.segment.close()
            conn.segment = None
        conn.segment = shm.offer(conn.sock, nbytes, conn.read_reply)
        conn.local = conn.segment is not None
        return conn.segment

    def _send(self, call: BulkCall, conn: _Conn) -> None:
        sock = conn.sock
        if conn.fresh:
            send_hello(sock, self._token)
            conn.fresh = False
        sock.settimeout(self._io_timeout + call.wait_s)
        payload_bytes = call.payload_bytes
        segment = self._segment(conn, max(payload_bytes, call.target_bytes))
        request = call.request
        request.shm_reply = segment is not None
        request.shm_bytes = payload_bytes if segment is not None else 0
        if segment is not None and payload_bytes:
            segment.write(call.payloads)
            header = request.SerializeToString()
            sock.sendall(PREFIX.pack(len(header), 0) + header)
            return
        header = request.SerializeToString()
        # the frame's head and the small payloads after it leave in one send (a W2 push: 5 syscalls -> 2)
        pending = [PREFIX.pack(len(header), payload_bytes), header]
        for payload in call.payloads:
            if payload.nbytes <= COALESCE_BYTES:
                pending.append(np.ascontiguousarray(payload).tobytes())
                continue
            sock.sendall(b"".join(pending))
            pending = []
            send_buffer(sock, np.ascontiguousarray(payload).data)
        if pending:
            sock.sendall(b"".join(pending))

    def _await_reply(self, call: BulkCall, conn: _Conn) -> None:
        """With a `stalled` hook: wait for the reply's first bytes in check_s slices, asking the hook after each,
        so a call to a SIGSTOPped primary the replica table no longer lists ends at the next check, not after
        io_timeout. A reply starts on an empty read buffer (each reply is read whole), so the socket tells."""
        sock = conn.sock
        if self._stalled is None or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        limit = time.monotonic() + self._io_timeout + call.wait_s
        while not poller.poll(1000 * max(0.0, min(self._check_s, limit - time.monotonic()))):
            if time.monotonic() >= limit:
                return  # the read's own timeout reports it
            if self._stalled(call.ps, call.request):
                raise ConnectionError(f"no reply after {self._check_s} s and the replica table moved this call's "
                                      "shards to another PS")

    def _receive(self, call: BulkCall, conn: _Conn) -> None:
        self._await_reply(call, conn)
        reply, payload_len = conn.read_reply()
        if reply.code:
            conn.skip(payload_len)
            raise from_status(STATUS_BY_VALUE.get(reply.code, STATUS_BY_VALUE[13]),
                              f"ps {call.ps}: {reply.message}")
        declined = reply.HasField("push") and not reply.pull.tensors  # a push-pull an accumulating PS answered
        if call.targets and not declined:
            shared = reply.shm_bytes
            segment = conn.segment if shared and not payload_len else None
            fits = not shared or (segment is not None and shared <= segment.capacity)
            if not fits or (shared or payload_len) != call.target_bytes or \
                    len(reply.pull.tensors) != len(call.targets):
                raise InternalError(f"ps {call.ps}: bulk reply of {payload_len} + {shared} shared bytes does not "
                                    f"match the request")
            if segment is not None:
                segment.read_into(call.targets)
            else:
                for target in call.targets:
                    conn.read_into(target)
            if reply.HasField("push"):  # fused push-pull: the values are in the targets
                reply.push.values.extend(reply.pull.tensors)
        call.reply = reply

    def _one(self, call: BulkCall) -> None:
        conn = self._acquire(call.ps)
        try:
            self._send(call, conn)
            self._receive(call, conn)
        except (OSError, ConnectionError) as exc:
            raise self._fail(call.ps, conn, exc) from exc
        except BaseException:
            conn.close()  # state of the stream unknown after an error reply with a bad payload
            raise
        self._release(call.ps, conn)

    def run(self, calls: Sequence[BulkCall]) -> None:
        """Perform calls (at most one per PS is best) in parallel; fills each call.reply."""
        if len(calls) == 1:
            self._one(calls[0])
            return
        if sum([c.nbytes for c in calls]) > THREADED_BYTES:
            for fut in [self._pool.submit(self._one, c) for c in calls]:
                fut.result()
            return
        opened: list[tuple[BulkCall, _Conn]] = []
        try:
            for call in calls:
                conn = self._acquire(call.ps)
                opened.append((call, conn))
                self._send(call, conn)
            while opened:
                call, conn = opened[0]
                self._receive(call, conn)
                opened.pop(0)
                self._release(call.ps, conn)
        except (OSError, ConnectionError) as exc:
            errors = [self._fail(call.ps, conn, exc) for call, conn in opened]  # a PS may have restarted
            raise (errors[0] if errors else UnavailableError(f"bulk connection failed: {exc}")) from exc
        except BaseException:
            for _, conn in opened:
                conn.close()
            raise


_LITTLE_ORDERS = ("<", "|", "=") if sys.byteorder == "little" else ("<", "|")


def _wire(array: np.ndarray) -> np.ndarray:
    """array as the bytes the wire carries: C-contiguous, little-endian (a copy only when it is not)."""
    if array.flags.c_contiguous and array.dtype.byteorder in _LITTLE_ORDERS:
        return array
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)


class BulkTensors:
    """The TensorTransport over the framed bulk ports: raw tensor bytes after a protobuf header."""

    def __init__(self, client: BulkClient) -> None:
        self._client = client

    def pull(self, plan: PullPlan) -> None:
        """Receive each item's tensor straight into its target; one request per PS task."""
        self._client.run([BulkCall(ps, pb.BulkRequest(pull=pb.PullRequest(items=[i for i, _ in items])),
                                   targets=[t for _, t in items]) for ps, items in plan.items()])

    def push(self, plan: PushPlan, head: pb.PushRequest, targets: ValueTargets | None = None) -> list[pb.PushReply]:
        """Send each item's gradient bytes after its header; one request per PS task, replies in plan order
        (with `head.return_values`, values are received straight into `targets`)."""
        calls = []
        for ps, items in plan.items():
            request = pb.PushRequest(items=[item for item, _ in items], push_id=head.push_id, step=head.step,
                                     final_below=head.final_below, return_values=head.return_values,
                                     skip_step=head.skip_step)
            calls.append(BulkCall(ps, pb.BulkRequest(push=request), payloads=[_wire(p) for _, p in items],
                                  targets=targets[ps] if targets and head.return_values else ()))
        self._client.run(calls)
        return [c.reply.push for c in calls if c.reply is not None]

    def take_token(self, request: pb.TokenRequest, ps: int = 0) -> pb.TokenReply:
        """A sync token from PS ps's queue (the PS holds the reply while none is free)."""
        call = BulkCall(ps, pb.BulkRequest(take_token=request), wait_s=request.timeout_s)
        self._client.run([call])
        assert call.reply is not None
        return call.reply.token

    def step_done(self, request: pb.StepDoneRequest, ps: int = 0) -> pb.StepReply:
        """Report a closure's finished step to PS ps's queue."""
        call = BulkCall(ps, pb.BulkRequest(step_done=request))
        self._client.run([call])
        assert call.reply is not None
        return call.reply.step

    def moved(self, ps: int, address: str) -> None:
        """PS ps moved: its bulk port is asked again, at its new host."""
        self._client.moved(ps, address.rpartition(":")[0])

    def close(self) -> None:
        """Close every pooled connection."""
        self._client.close()
