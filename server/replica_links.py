"""How a primary's forwards reach a backup PS (replicas: 2): the framed bulk port, or gRPC without one.

A batch is a ReplicateRequest whose tensors carry dtype and shape only, plus its arrays in `tensors_of`
order. `FrameLink` sends the header and then the arrays' bytes straight from their buffers (on a plain
socket in one sendmsg: the backup's thread finds the whole batch and wakes once, not once per piece) over one
long-lived framed connection to the backup's bulk port (server/bulk.py's `replicate`): no protobuf copy
of a gradient, no gRPC call per batch. B15 measured the gRPC path at ~3.5 ms of PS CPU per W2 step, more
than the step's own push and pull. `GrpcLink` (a cluster with `bulk_transport: false`) copies the bytes
into the tensors' data fields and makes the Replicate call.
"""

from __future__ import annotations

import math
import socket
import ssl
import threading
from collections.abc import Callable, Sequence

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.server import replica_wire

from pscluster import codec
from pscluster.config import Settings
from pscluster.errors import InvalidArgumentError, UnavailableError, from_status
from pscluster.net import framing, rpc, shm, tls


def tensors_of(f: pb.ReplicaForward) -> list[pb.Tensor]:
    """A forward's tensors in payload order: an install's value then its slots by name, none for a config
    change or the sync state, a table pull's keys, else grad then rows."""
    if f.HasField("spec"):
        return [f.value] + [f.slots[name] for name in sorted(f.slots)]
    if f.HasField("optimizer") or f.HasField("sync_state") or f.skipped:
        return []
    if f.pulled or f.swept:
        return [f.rows]  # a table pull's distinct keys, or the keys a sweep evicted
    return [f.grad, f.rows] if f.has_rows else [f.grad]


def payload_views(request: pb.ReplicateRequest, buf: np.ndarray) -> list[np.ndarray]:
    """The arrays of a framed batch: views of buf (its payload) cut by the headers, in `tensors_of` order.

    Raises:
        InvalidArgumentError: a bad dtype or shape, or shapes that do not add up to buf's size.
    """
    out = []
    offset = 0
    for f in request.forwards:
        for t in tensors_of(f):
            dt = codec.wire_dtype(t.dtype)
            shape = tuple(int(s) for s in t.shape)
            if any(s < 0 for s in shape):
                raise InvalidArgumentError(f"replicate {f.ref.variable}: negative dimension in {shape}")
            end = offset + math.prod(shape) * dt.itemsize
            if end > buf.size:
                raise InvalidArgumentError("replicate: payload holds fewer bytes than the shapes announce")
            out.append(buf[offset:end].view(dt).reshape(shape))
            offset = end
    if offset != buf.size:
        raise InvalidArgumentError(f"replicate: payload of {buf.size} bytes, shapes announce {offset}")
    return out


# the largest batch that goes through a link's segment (a replicator's batches group up to 16 MiB); a larger one
# (a catch-up's whole state: rare) rides the socket, so a link's segment stays at most this large in /dev/shm
SEGMENT_MAX_BYTES = 16 << 20
COALESCE_BYTES = 64 << 10  # arrays up to this size leave in the send of the frame's head (as the client's)
GATHER_BUFFERS = 256  # a plain socket's batch of up to this many buffers leaves in sendmsg calls (under IOV_MAX)


def _send_batch(sock: socket.socket, header: bytes, views: Sequence[np.ndarray]) -> None:
    """The frame's head and then the arrays' bytes. On a plain socket sendmsg gathers them straight from
    their buffers, a CHUNK per call (a W2 batch: one call instead of two sends and a join of copies); TLS, or a
    batch of more buffers, copies small arrays into the send of the head and sends larger ones from theirs."""
    head = framing.PREFIX.pack(len(header), sum(v.size for v in views)) + header
    if not isinstance(sock, ssl.SSLSocket) and len(views) < GATHER_BUFFERS:
        _gather(sock, [memoryview(head)] + [v.data.cast("B") for v in views if v.size])
        return
    pending = [head]
    for v in views:
        if v.size <= COALESCE_BYTES:
            pending.append(v.tobytes())
            continue
        sock.sendall(b"".join(pending))
        pending = []
        framing.send_buffer(sock, v.data)
    if pending:
        sock.sendall(b"".join(pending))


def _gather(sock: socket.socket, buffers: list[memoryview]) -> None:
    """sendmsg until every buffer is sent; each call sends at most framing.CHUNK bytes and is bounded by sock's
    timeout (a stalled reader raises TimeoutError), as send_buffer's pieces are."""
    while buffers:
        batch: list[memoryview] = []
        size = 0
        for b in buffers:
            if size + len(b) > framing.CHUNK:
                if not batch:
                    batch.append(b[:framing.CHUNK])  # a large buffer alone: a CHUNK of it
                break
            batch.append(b)
            size += len(b)
        sent = sock.sendmsg(batch)
        while sent:  # drop what left; a partly sent buffer keeps its rest
            if sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


class GrpcLink:
    """The Replicate RPC to one backup PS over gRPC, with the cluster's token and TLS."""

    def __init__(self, address: str, settings: Settings) -> None:
        self.address = address
        self._channel = rpc.open_channel(address, settings)
        self._stub = pb_grpc.ParameterServerStub(self._channel)

    def status(self, timeout: float) -> pb.PsStatus:
        """The backup's Status (its bulk port)."""
        reply: pb.PsStatus = rpc.call(self._stub.Status, pb.PsStatusRequest(), timeout=timeout,
                                           what=f"status of {self.address}")
        return reply

    def replicate(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray],
                  timeout: float) -> pb.ReplicateReply:
        """One batch, one deadline (the replicator resends on failure): the bytes ride in the message."""
        full = pb.ReplicateRequest()
        full.CopyFrom(request)
        it = iter(arrays)
        for f in full.forwards:
            for t in tensors_of(f):
                t.data = np.ascontiguousarray(next(it)).tobytes()
        reply: pb.ReplicateReply = rpc.call(self._stub.Replicate, full, timeout=timeout,
                                            what=f"replicate to {self.address}")
        return reply

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


class FrameLink:
    """Batches to one backup PS over its framed bulk port (asked from its Status when first needed).

    Used by one replicator thread at a time; `close` may come from another thread (the lock guards the socket).
    """

    def __init__(self, address: str, settings: Settings, port_of: Callable[[float], int] | None = None) -> None:
        """port_of(timeout): the backup's bulk port (default: from its Status over gRPC)."""
        self.address = address
        self._host = address.rpartition(":")[0]
        self._grpc = GrpcLink(address, settings)
        self._port_of = port_of or (lambda timeout: int(self._grpc.status(timeout).bulk_port))
        self._token = settings.token_value()
        files = tls.files(settings)
        self._tls: ssl.SSLContext | None = tls.client_context(files) if files else None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        # same host, no TLS: the batches' bytes go through a shared-memory segment (pscluster/net/shm.py) and
        # the backup serves them on its frame loop (server/bulk.py's `inline`); False once one was declined
        self._local = False
        self._segment: shm.Segment | None = None

    def _connect(self, timeout: float) -> socket.socket:
        port = self._port_of(timeout)
        if not port:
            raise UnavailableError(f"backup ps {self.address} serves no bulk port")
        sock = framing.connect(self._host, port, timeout, self._tls)
        try:
            sock.settimeout(timeout)
            framing.send_hello(sock, self._token)
        except BaseException:
            sock.close()  # not kept anywhere yet: nobody else would close it
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise UnavailableError(f"link to {self.address} closed")
            self._sock = sock
            self._local = self._tls is None and shm.available() and shm.is_local_peer(sock)
        return sock

    def _shared(self, sock: socket.socket, nbytes: int) -> shm.Segment | None:
        """The connection's segment for a batch of nbytes (a larger one offered when it does not fit), or None:
        the bytes ride the socket (another host, TLS, no /dev/shm, over SEGMENT_MAX_BYTES, or declined)."""
        if nbytes > SEGMENT_MAX_BYTES:
            return None
        segment = self._segment
        if segment is not None and nbytes <= segment.capacity:
            return segment
        if not self._local:
            return None
        if segment is not None:
            with self._lock:  # `close` may race this: whoever takes it from the link closes it
                taken = self._segment is segment
                if taken:
                    self._segment = None
            if taken:
                segment.close()
        # every size: a batch on the socket could not be served on the backup's loop
        offered = shm.offer(sock, max(nbytes, shm.MIN_BYTES), lambda: framing.read_reply(sock))
        with self._lock:
            kept = not self._closed and self._sock is sock
            if kept:
                self._segment = offered
                self._local = offered is not None
        if not kept:
            if offered is not None:
                offered.close()
            raise UnavailableError(f"link to {self.address} closed")
        return offered

    def replicate(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray],
                  timeout: float) -> pb.ReplicateReply:
        """Send one batch and read its reply; any failure drops the connection (the next batch reconnects).

        A kept connection that fails is replaced and the batch sent once more at once (the backup closed an
        idle connection, or restarted); the backup ignores versions it holds already.
        """
        return self._exchange(pb.BulkRequest(replicate=request), arrays, timeout).replicate

    def replicate_dense(self, forwards: Sequence[bytes], arrays: Sequence[np.ndarray],
                        timeout: float) -> tuple[list[int], list[int]]:
        """As `replicate`, for a batch of dense updates in the compact form (server/replica_wire.py):
        (outcomes, versions)."""
        reply = self._exchange(pb.BulkRequest(replicate_dense=replica_wire.request(forwards)), arrays, timeout)
        try:
            return replica_wire.decode_reply(reply.replicate_dense, len(forwards))
        except InvalidArgumentError as exc:  # the stream is in step, but its peer is not: never reused
            self._drop(self._sock)
            raise UnavailableError(f"replicate to {self.address} (bulk port): {exc}") from exc

    def _exchange(self, request: pb.BulkRequest, arrays: Sequence[np.ndarray], timeout: float) -> pb.BulkReply:
        """Send a batch's frame (header, then the arrays' bytes, or the header alone and the bytes in the
        segment) and read its reply (see `replicate`). The backup reads the segment until it answers, and
        nothing is written there before the next batch (one at a time)."""
        views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
        nbytes = sum([v.size for v in views])
        for attempt in (0, 1):
            sock = self._sock
            kept = sock is not None
            try:
                if sock is None:
                    sock = self._connect(timeout)
                sock.settimeout(timeout)
                segment = self._shared(sock, nbytes) if nbytes else None
                if segment is not None:
                    segment.write(views)
                    request.shm_bytes = nbytes
                    framing.send_frame(sock, request.SerializeToString())
                else:
                    request.shm_bytes = 0
                    _send_batch(sock, request.SerializeToString(), views)
                reply, payload_len = framing.read_reply(sock)
                break
            except OSError as exc:
                self._drop(sock)
                if not kept or attempt:
                    raise UnavailableError(f"replicate to {self.address} (bulk port): {exc}") from exc
            except Exception as exc:  # a reply that does not parse: the stream is out of step, never reused
                self._drop(sock)
                raise UnavailableError(f"replicate to {self.address} (bulk port): a broken reply: {exc}") from exc
        if reply.code or payload_len:
            self._drop(sock)
            raise from_status(framing.STATUS_BY_VALUE.get(reply.code, framing.STATUS_BY_VALUE[13]),
                              f"backup {self.address}: {reply.message}") if reply.code else \
                UnavailableError(f"backup {self.address} answered a replicate with a payload")
        return reply

    def _drop(self, sock: socket.socket | None) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
                segment, self._segment = self._segment, None
            else:
                segment = None
        if sock is not None:
            sock.close()
        if segment is not None:  # a new connection offers a new one: the backup may still read this one
            segment.close()

    def close(self) -> None:
        """Close the connection and the gRPC channel."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            segment, self._segment = self._segment, None
        if sock is not None:
            sock.close()
        if segment is not None:
            segment.close()
        self._grpc.close()
