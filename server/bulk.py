"""The PS side of the bulk tensor path: pull and push handlers on a FrameServer.

Why beside gRPC: grpcio moves large messages at ~0.1-0.35 GB/s and costs ~0.5 ms per call here;
a framed socket moves numpy buffers with `sendall`/`recv_into` at memory-copy speed. Dense pulls are
sent a piece at a time: each piece is copied under the shard lock into the connection's own
PULL_COPY_BYTES buffer and sent after the lock is released, so a reader that stops reading (a
SIGSTOPped worker) blocks only its own connection thread, never a push or a checkpoint, until the
socket's io timeout closes it. Memory stays 1x the variable plus 1 MiB per pulling connection (a
copy-on-write shard would need a second full copy while a stalled reader holds the old one). 1 MiB
stays in cache between the copy and the send: B1 pulls measured 4.1 GB/s with it, 2.1-3.4 with
4 MiB, 3.3-3.4 with 256 KiB (same runs). Sending straight from shard memory without the lock is
not an option: a concurrent in-place update could tear a float in the kernel's byte copy.
Pushes are received into one buffer, validated completely, then applied by the same
`ParameterServerCore` as gRPC pushes; a push that asks for values (fused push-pull) is answered like
a pull of its shards, right after they were updated.
"""

from __future__ import annotations

import math
import socket
import ssl
import time
from typing import Any

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import replica_links, replica_wire
from pscluster.server.ps import ParameterServerCore
from pscluster.server.store import PushItem, Shard

from pscluster import codec
from pscluster.errors import FailedPreconditionError, InvalidArgumentError, PermissionDeniedError
from pscluster.net import shm, tls
from pscluster.net.frame_server import ON_LOOP, FrameServer
from pscluster.net.framing import PREFIX, drain, recv_into, refuse_payload, send_buffer, send_frame

PULL_COPY_BYTES = 1 << 20  # per pulling connection; see the module docstring
REUSE_BYTES = 64 << 20  # pushes up to this size land in a per-connection buffer (no page faults)
LARGE_BATCHES = "large_batches"  # a replica link's state: it sent a batch too large for the loop (`inline`)
INLINE_BYTES = 1 << 20  # larger pushes and pulls get a thread, so their copies never delay the small ones


class BulkHandlers:
    """Serves framed pulls and pushes for one PS core."""

    def __init__(self, core: ParameterServerCore) -> None:
        self.core = core
        # a dense shard's reply header (dtype, shape) never changes: built once per shard object, not per
        # pull; one entry per shard key (a restored or recreated shard replaces its entry)
        self._headers: dict[tuple[str, int], tuple[Shard, pb.Tensor]] = {}
        self._max_shared = shm.MAX_BYTES  # the largest segment region a client may offer (server() narrows it)
        # what the compact form's constant parts decode to (server/replica_wire.py), shared by the connections
        # (a dict's reads and writes are atomic; a race decodes a part twice)
        self._dense_kept: dict[bytes, tuple[tuple[str, int], np.dtype, tuple[int, ...], int]] = {}

    def _header_of(self, shard: Shard) -> pb.Tensor:
        entry = self._headers.get(shard.spec.key)
        if entry is None or entry[0] is not shard:
            entry = self._headers[shard.spec.key] = (shard, codec.header(shard.value.dtype, shard.value.shape))
        return entry[1]

    def server(self, host: str, token: str | None, max_header_bytes: int, port: int = 0,
               **limits: Any) -> FrameServer:
        """A FrameServer with this PS's handlers on port (0: any free port), not started; limits: framing.limits."""
        self._max_shared = min(self._max_shared, int(limits.get("max_payload_bytes", shm.MAX_BYTES)))
        return FrameServer(host, token, {"pull": self.pull, "push": self.push, "take_token": self.take_token,
                                         "step_done": self.step_done, "shm_attach": self.shm_attach,
                                         "replicate": self.replicate, "replicate_dense": self.replicate},
                           max_header_bytes, name="bulk", port=port, inline=self.inline, **limits)

    def inline(self, request: pb.BulkRequest, state: dict[str, Any]) -> bool:
        """Whether request may be served on the frame server's loop thread: a dense push or pull whose
        bytes go through the connection's segment, at most INLINE_BYTES each way, answered at once; or a
        primary's batch of forwards without a whole state, its bytes (if any) in the segment."""
        segment: shm.Segment | None = state.get("shm")
        kind = request.WhichOneof("op")
        if kind in ("replicate", "replicate_dense"):
            # a primary's batch (replicas: 2) is applied and answered at once, so its connection needs no thread
            # while its batches are small (`replicate` notes the first large one); a whole state (a catch-up,
            # rare) goes to a thread and back
            return not state.get(LARGE_BATCHES) and not _installs(request) and \
                (not request.shm_bytes or (segment is not None and request.shm_bytes <= INLINE_BYTES))
        replication, sync = self.core.replication, self.core.sync
        # with the table a sync push waits for its step (other peers' pushes) to settle: never on the loop
        waits = replication is not None and (replication.forwards() or (sync is not None and sync.accumulates))
        if segment is None or state.get("takes_tokens") or waits:
            # replicas: 2: a push's reply waits for the backup, which must not stall the loop's other peers
            # (with one copy, elastic, only while a shard of this PS moves: served here otherwise);
            # its connection keeps a thread of its own (served here, every pull would hand it back to the
            # loop and every push to a new thread: a thread per step)
            # a token may wait for other workers, so it is never served by the loop; moving its connection
            # to a thread and back every step would cost a thread per step
            return False
        if kind == "push":
            if request.shm_bytes > INLINE_BYTES:
                return False
            if any(item.HasField("ids") for item in request.push.items):
                # a table's pushes alternate with its row pulls, which stay on a thread (their ids are not
                # known to fit): served here, the push would hand the connection to a new thread every batch
                return False
            # a fused reply of dense shards is exactly as large as the push (`push` validates that) and
            # goes back through the same segment; any other reply is a small header
            return not request.push.return_values or request.shm_reply
        if kind != "pull" or not request.shm_reply:
            return False  # tokens may wait; the rest is rare
        total = 0
        for item in request.pull.items:
            shard = None if item.HasField("ids") else self.core.store.find((item.ref.variable, item.ref.shard_index))
            if shard is None:
                return False  # rows are sized by their ids; an unknown shard's NOT_FOUND comes from a thread
            total += shard.value.nbytes
        return total <= min(segment.capacity, INLINE_BYTES)

    def shm_attach(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int,
                   state: dict[str, Any]) -> None:
        """Map a same-host client's segment for this connection's payloads (pscluster/net/shm.py)."""
        refuse_payload(conn, payload_len, "shm_attach")
        if isinstance(conn, ssl.SSLSocket) or not shm.is_local_peer(conn):
            raise FailedPreconditionError("shared memory is for plain connections from this host")
        offer = request.shm_attach
        segment = shm.Segment.attach(offer.name, offer.nonce, offer.size, self._max_shared)
        old = state.get("shm")
        if old is not None:
            old.close()
        else:
            state.setdefault("on_close", []).append(lambda: state["shm"].close())
        state["shm"] = segment
        send_frame(conn, pb.BulkReply().SerializeToString())

    def take_token(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int,
                   state: dict[str, Any]) -> None:
        """A sync/bounded token from this PS's queue (PS 0), as the TakeToken RPC."""
        refuse_payload(conn, payload_len, "take_token")
        # a connection that takes sync tokens keeps a thread of its own (see `inline`)
        state["takes_tokens"] = True
        req = request.take_token
        step, replica = self.core.replicas().take_token(req.closure_id, req.worker, req.timeout_s or 30.0,
                                                        [(r.closure_id, r.step, r.worker) for r in req.reports])
        send_frame(conn, pb.BulkReply(token=pb.TokenReply(step=step, replica=replica)).SerializeToString())

    def step_done(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int,
                  state: dict[str, Any]) -> None:
        """A closure's step report, as the StepDone RPC."""
        refuse_payload(conn, payload_len, "step_done")
        req = request.step_done
        epoch, version = self.core.replicas().step_done(req.closure_id, req.step, req.worker)
        reply = pb.StepReply(global_step=self.core.global_step, sync_epoch=epoch, sync_version=version)
        send_frame(conn, pb.BulkReply(step=reply).SerializeToString())

    def replicate(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int,
                  state: dict[str, Any]) -> None:
        """A primary's batch of forwards for this backup (replicas: 2), as the Replicate RPC; with mutual
        TLS only a PS certificate may send one."""
        segment = _shared_payload(conn, request, payload_len, state)
        if (payload_len or request.shm_bytes > INLINE_BYTES) and not _installs(request):
            # from now on this link's batches keep a thread (`inline`): group commit makes their sizes vary
            # around any limit, and a connection moving between the loop and a new thread costs a thread a batch
            state[LARGE_BATCHES] = True
        if segment is not None:  # read in place: the primary writes no more there until this batch is answered
            payload_len = request.shm_bytes
            buf = segment.region[:payload_len]
        else:
            buf = self._payload(conn, payload_len, state)
        peer = conn.getpeercert() if isinstance(conn, ssl.SSLSocket) else None
        if peer and tls.role_of_peercert(peer) != "ps":  # a verified certificate of another role
            raise PermissionDeniedError("replicate: only a PS certificate may forward updates")
        if self.core.replication is None:
            raise FailedPreconditionError(f"replicate: ps {self.core.ps_index} runs with replicas: 1; "
                                          "start the cluster with replicas: 2")
        if request.HasField("replicate_dense"):  # dense updates only: the compact form (server/replica_wire.py)
            forwards = replica_wire.decode_request(request.replicate_dense, payload_len, self._dense_kept)
            outcomes, versions = self.core.replication.receive_dense(forwards, replica_wire.views(forwards, buf))
            send_frame(conn, pb.BulkReply(replicate_dense=replica_wire.reply(outcomes, versions)).SerializeToString())
            return
        arrays = replica_links.payload_views(request.replicate, buf)
        # a payload above REUSE_BYTES has a buffer of its own: an install may keep it as the shard's memory
        reply = self.core.replication.receive(request.replicate, arrays,
                                              owned=segment is None and payload_len > REUSE_BYTES)
        send_frame(conn, pb.BulkReply(replicate=reply).SerializeToString())

    def _payload(self, conn: socket.socket, payload_len: int, state: dict[str, Any]) -> np.ndarray:
        """Read a payload into the connection's reused buffer (one of its own above REUSE_BYTES)."""
        if payload_len > REUSE_BYTES:
            buf = np.empty(payload_len, np.uint8)
        else:
            scratch: np.ndarray | None = state.get("scratch")
            if scratch is None or scratch.size < payload_len:
                scratch = state["scratch"] = np.empty(payload_len, np.uint8)
            buf = scratch[:payload_len]
        recv_into(conn, buf.data)
        return buf

    def _observe(self, op: str, nbytes: int, started: float) -> None:
        if self.core.metrics is not None:
            self.core.metrics.observe(op, "bulk", nbytes, started)

    def push(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int, state: dict[str, Any]) -> None:
        """Receive a push's payload, validate it whole, apply it, reply."""
        started = time.perf_counter()
        req = request.push
        segment = _shared_payload(conn, request, payload_len, state)
        if segment is not None:
            payload_len = request.shm_bytes
        scratch: np.ndarray | None = state.get("scratch")
        if payload_len <= REUSE_BYTES and (scratch is None or scratch.size < payload_len):
            scratch = state["scratch"] = np.empty(payload_len, np.uint8)
        buf = scratch[:payload_len] if scratch is not None and payload_len <= REUSE_BYTES else \
            np.empty(payload_len, np.uint8)
        if segment is not None:
            buf[:] = segment.region[:payload_len]  # a copy: the client cannot change it after validation
        else:
            recv_into(conn, buf.data)
        fused = req.return_values and self.core.returns_values(req.items)
        # a fused push-pull answered through the segment: each shard's new value is copied there while
        # its update still holds the lock (a push of dense shards is validated to be exactly their size)
        reply_segment: shm.Segment | None = state.get("shm") if fused and request.shm_reply else None
        into = reply_segment.region[:payload_len] if reply_segment is not None and \
            payload_len <= reply_segment.capacity else None
        try:
            items = push_items(req.items, buf, payload_len)
            results = self.core.push(req.push_id, req.step, items, req.final_below, into, req.skip_step,
                                     bool(state.get(ON_LOOP)))
        finally:
            items = []
            del buf  # a large one-off buffer goes back to the OS before the reply, not after
        self._observe("push", payload_len, started)
        reply = pb.BulkReply(push=pb.PushReply(versions=[r.version for r in results],
                                               applied=[r.applied for r in results],
                                               incarnation=self.core.incarnation))
        if into is not None:
            store = self.core.store
            reply.pull.tensors.extend([self._header_of(store.get((i.ref.variable, i.ref.shard_index)))
                                       for i in req.items])
            reply.pull.versions.extend([r.current for r in results])
            reply.shm_bytes = payload_len
            send_frame(conn, reply.SerializeToString())
            return
        if fused:
            # fused push-pull over the socket: the shards' values after this push follow, as a pull's would
            self._reply_with_values(conn, reply, [(None, (i.ref.variable, i.ref.shard_index)) for i in req.items],
                                    state, request.shm_reply)
            return
        send_frame(conn, reply.SerializeToString(), 0)

    def pull(self, conn: socket.socket, request: pb.BulkRequest, payload_len: int, state: dict[str, Any]) -> None:
        """Reply with the shards' dtype/shape/version, then their bytes straight from shard memory."""
        started = time.perf_counter()
        refuse_payload(conn, payload_len, "pull")
        wanted = [(codec.decode_ids(item.ids) if item.HasField("ids") else None,
                   (item.ref.variable, item.ref.shard_index)) for item in request.pull.items]
        if self.core.replication is not None:  # replicas: 2: a backup may be a batch behind, or catching up
            self.core.replication.check_primary(key for _, key in wanted)
        total = self._reply_with_values(conn, pb.BulkReply(), wanted, state, request.shm_reply)
        self._observe("pull", total, started)

    def _reply_with_values(self, conn: socket.socket, reply: pb.BulkReply,
                           wanted: list[tuple[np.ndarray | None, tuple[str, int]]], state: dict[str, Any],
                           shared: bool = False) -> int:
        """Send reply with `reply.pull` describing each wanted shard (or its rows `ids`), then their bytes
        (in the connection's segment if `shared` asks and they fit, else after the header)."""
        store = self.core.store
        segment: shm.Segment | None = state.get("shm") if shared else None
        # (shard, its local rows for a fixed table's ids, or rows and version made already: a dynamic table's)
        located: list[tuple[Shard, np.ndarray | None, tuple[np.ndarray, int] | None]] = []
        for ids, key in wanted:
            shard = store.get(key)
            if ids is not None and shard.table is not None:
                located.append((shard, None, store.pull(key, ids)))
            else:
                located.append((shard, None if ids is None else store.rows_of(key, ids)[1], None))
        total = sum(made[0].nbytes if made is not None else shard.value.nbytes if local is None
                    else local.size * _row_bytes(shard) for shard, local, made in located)
        if segment is not None and total <= segment.capacity:
            # a fixed table's rows are gathered straight into the segment (no copy of them in between),
            # under the shard's lock with the version they are of
            fill = 0
            for shard, local, made in located:
                if made is not None:
                    rows, version = made
                    reply.pull.tensors.append(codec.header(rows.dtype, rows.shape))
                    reply.pull.versions.append(version)
                    segment.region[fill:fill + rows.nbytes] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
                    fill += rows.nbytes
                elif local is None:
                    reply.pull.tensors.append(self._header_of(shard))
                    reply.pull.versions.append(shard.version)
                    store.copy_into(shard, segment.region[fill:fill + shard.value.nbytes])
                    fill += shard.value.nbytes
                else:
                    shape = (local.size,) + shard.value.shape[1:]
                    nbytes = local.size * _row_bytes(shard)
                    out = segment.region[fill:fill + nbytes].view(shard.dtype).reshape(shape)
                    reply.pull.tensors.append(codec.header(shard.dtype, shape))
                    reply.pull.versions.append(store.take_rows_into(shard, local, out))
                    fill += nbytes
            reply.shm_bytes = total
            send_frame(conn, reply.SerializeToString())
            return total
        parts: list[tuple[np.ndarray | None, Any]] = []
        for shard, local, made in located:
            if made is None and local is None:
                reply.pull.tensors.append(self._header_of(shard))
                reply.pull.versions.append(shard.version)
                parts.append((None, shard))
                continue
            if made is None and local is not None:
                rows = np.empty((local.size,) + shard.value.shape[1:], shard.dtype)
                made = rows, store.take_rows_into(shard, local, rows)
            if made is not None:
                reply.pull.tensors.append(codec.header(made[0].dtype, made[0].shape))
                reply.pull.versions.append(made[1])
                parts.append((made[0], None))
        header = reply.SerializeToString()
        try:
            self._send_parts(conn, PREFIX.pack(len(header), total) + header, parts, state)
        except OSError:
            raise
        except Exception as exc:  # the header is out: an error frame now would be read as tensor bytes
            raise ConnectionError(f"pull failed mid-reply: {type(exc).__name__}: {exc}") from exc
        return total

    def _send_parts(self, conn: socket.socket, head: bytes, parts: list[tuple[np.ndarray | None, Any]],
                    state: dict[str, Any]) -> None:
        """Send the frame's head, then each part's bytes. Whatever fits goes through the connection's copy
        buffer and leaves in one send (a W2 pull: 5 shards, one syscall instead of six); a larger shard
        is sent piece by piece as before."""
        out = state.get("pull_chunk")
        if out is None:
            out = state["pull_chunk"] = np.empty(PULL_COPY_BYTES, np.uint8)
        fill = 0
        if len(head) <= out.size:
            out[:len(head)] = np.frombuffer(head, np.uint8)
            fill = len(head)
        else:
            conn.sendall(head)
        for rows, shard in parts:
            nbytes = rows.nbytes if rows is not None else shard.value.nbytes
            if fill + nbytes <= out.size:
                if rows is not None:
                    out[fill:fill + nbytes] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
                else:
                    self.core.store.copy_into(shard, out[fill:fill + nbytes])
                fill += nbytes
                continue
            if fill:
                conn.sendall(out[:fill].data)  # outside every shard lock
                fill = 0
            if rows is not None:
                send_buffer(conn, rows.data)
                continue
            for piece in self.core.store.copy_chunks(shard, out):
                conn.sendall(piece)  # outside the shard lock: a stalled reader stalls only this thread
        if fill:
            conn.sendall(out[:fill].data)


def _row_bytes(shard: Shard) -> int:
    """Bytes of one row of shard (axis 0)."""
    return shard.value.nbytes // shard.value.shape[0] if shard.value.shape and shard.value.shape[0] else 0


def _installs(request: pb.BulkRequest) -> bool:
    """Whether a replicate batch carries a whole state (a catch-up: rare, large, served on a thread)."""
    return any(f.HasField("spec") for f in request.replicate.forwards)


def _shared_payload(conn: socket.socket, request: pb.BulkRequest, payload_len: int,
                    state: dict[str, Any]) -> shm.Segment | None:
    """The connection's segment when request's payload is in it; None when the payload is on the socket.

    Raises:
        InvalidArgumentError: a shared payload without a segment, larger than it, or also on the socket.
    """
    if not request.shm_bytes:
        return None
    segment: shm.Segment | None = state.get("shm")
    if payload_len or segment is None or request.shm_bytes > segment.capacity:
        drain(conn, payload_len)
        raise InvalidArgumentError(f"a payload of {request.shm_bytes} shared bytes needs an attached segment that "
                                   f"holds them, and no bytes on the socket ({payload_len} sent)")
    return segment


def push_items(described: Any, buf: np.ndarray, payload_len: int) -> list[PushItem]:
    """A framed push's items: each PushItem's gradient is a view of `buf` (the payload), in item order.

    Raises:
        InvalidArgumentError: a bad dtype or shape, or shapes that do not add up to payload_len bytes.
    """
    items = []
    offset = 0
    for item in described:
        header = item.grad
        dt = codec.wire_dtype(header.dtype)
        shape = tuple(header.shape)
        if shape and min(shape) < 0:
            raise InvalidArgumentError(f"{item.ref.variable}: negative dimension in {shape}")
        end = offset + math.prod(shape) * dt.itemsize
        if end > payload_len:
            raise InvalidArgumentError(f"{item.ref.variable}: payload holds fewer bytes than the shapes announce")
        ref = item.ref
        items.append(PushItem((ref.variable, ref.shard_index), buf[offset:end].view(dt).reshape(shape),
                              codec.decode_ids(item.ids) if item.HasField("ids") else None))
        offset = end
    if offset != payload_len:
        raise InvalidArgumentError(f"payload of {payload_len} bytes, shapes announce {offset}")
    return items
