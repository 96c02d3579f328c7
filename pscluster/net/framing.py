"""Framed TCP transport shared by the bulk tensor path (PS) and closure dispatch (workers): the wire
format and the socket I/O both ends use (the server is pscluster/net/frame_server.py).

A frame is `<u32 header length><u64 payload length><header><payload>`; headers are BulkRequest /
BulkReply messages.

Timeouts: every accepted socket has `io_timeout_s` on each send and receive, so a peer that stops
reading or writing mid-frame loses its connection instead of holding a thread (and whatever it
waits behind) forever. Waiting for the *next* request on an idle connection is not a transfer and
is not bounded by it. Payloads go out through `send_buffer` in `CHUNK` pieces, so the timeout means
"no progress for that long", not "the whole payload within that long".
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import ssl
import struct
import termios

import grpc

from pscluster.errors import InvalidArgumentError, PsclusterError
from pscluster.proto import pscluster_pb2 as pb

PREFIX = struct.Struct("<IQ")
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CHUNK = 4 << 20  # bytes per send call of a payload: the unit of progress that io timeouts measure


GROW_BYTES = 1 << 20  # above this, a buffer grows with the bytes that arrive instead of being allocated up front


def recv_exact(conn: socket.socket, n: int, ready: bool = True) -> bytes:
    """n bytes from conn, or ConnectionError at EOF; memory follows the bytes received, not the n announced.
    ready: as recv_into's."""
    if n <= GROW_BYTES:
        buf = bytearray(n)
        recv_into(conn, memoryview(buf), ready)
        return bytes(buf)
    grown = bytearray()
    while len(grown) < n:
        piece = conn.recv(min(GROW_BYTES, n - len(grown)))
        if not piece:
            raise ConnectionError("connection closed")
        grown += piece
    return bytes(grown)


def drain(conn: socket.socket, n: int) -> None:
    """Read and drop n bytes (a payload sent where none belongs) through a small buffer."""
    scratch = memoryview(bytearray(min(n, 64 << 10)))
    while n > 0:
        k = conn.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("connection closed")
        n -= k


def recv_into(conn: socket.socket, target: memoryview, ready: bool = True) -> None:
    """Fill target from conn, or ConnectionError at EOF.

    ready: the bytes are likely there already (a frame's header after its prefix, a payload after its header):
    the first read takes what the kernel holds without the poll that a socket with a timeout makes before
    every call (B15FLOOR: 8 polls per replicated push, 3 of them before bytes already there); only what is
    still missing waits, bounded by conn's timeout.
    """
    got = 0
    n = len(target)
    if ready and n and type(conn) is socket.socket and conn.gettimeout() is not None:
        try:  # the descriptor is non-blocking (a timeout is set): at most what is there, never a wait
            got = os.readv(conn.fileno(), [target])
        except BlockingIOError:
            got = 0
        else:
            if got == 0:
                raise ConnectionError("connection closed")
    while got < n:
        k = conn.recv_into(target[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k


def send_frame(conn: socket.socket, header: bytes, payload_len: int = 0) -> None:
    """Send the prefix and header of a frame; the caller sends payload_len bytes after it."""
    conn.sendall(PREFIX.pack(len(header), payload_len) + header)


def send_buffer(conn: socket.socket, data: memoryview | bytes) -> None:
    """Send data in CHUNK pieces (each bounded by conn's timeout: a stalled reader raises TimeoutError)."""
    view = memoryview(data)
    if view.nbytes == 0:
        return
    view = view.cast("B")
    for start in range(0, len(view), CHUNK):
        conn.sendall(view[start:start + CHUNK])


def unsent_bytes(conn: socket.socket) -> int:
    """Bytes conn has sent that its peer has not taken yet (a reader that stopped reading has many)."""
    return int(struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])


def wait_readable(conn: socket.socket, timeout_s: float | None = None) -> bool:
    """Block until conn has data, EOF or an error (True), or timeout_s passes first (False).

    An idle wait: conn's own io timeout does not bound it, timeout_s does (None: forever).
    """
    pending = getattr(conn, "pending", None)  # a TLS socket may hold decrypted bytes the kernel no longer has
    if pending is not None and pending():
        return True
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


def send_hello(conn: socket.socket, token: str | None) -> None:
    """Open a framed connection: the first frame carries the token and nothing else (at most HELLO_MAX_BYTES)."""
    send_frame(conn, pb.BulkRequest(token=token or "").SerializeToString())


def read_reply(conn: socket.socket) -> tuple[pb.BulkReply, int]:
    """The next reply header on conn and the length of the payload that follows it."""
    header_len, payload_len = PREFIX.unpack(recv_exact(conn, PREFIX.size, ready=False))  # the peer's turn
    reply = pb.BulkReply()
    reply.ParseFromString(recv_exact(conn, header_len))
    return reply, payload_len


def refuse_payload(conn: socket.socket, payload_len: int, what: str) -> None:
    """For requests that carry none: drain a payload sent anyway (the stream stays in step) and refuse it.

    Raises:
        InvalidArgumentError: payload_len > 0.
    """
    if payload_len:
        drain(conn, payload_len)
        raise InvalidArgumentError(f"a {what} request carries no payload")


def reply_error(conn: socket.socket, err: PsclusterError) -> None:
    """Answer a request with err's status code and message."""
    try:
        send_frame(conn, pb.BulkReply(code=err.code.value[0], message=str(err)).SerializeToString())
    except OSError:
        pass


def connect(host: str, port: int, timeout: float, context: ssl.SSLContext | None,
            server_name: str | None = None) -> socket.socket:
    """A client connection to a framed port (TLS when context is given, verified against server_name or host)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if context is None:
        return sock
    try:
        return context.wrap_socket(sock, server_hostname=server_name or host)
    except BaseException:
        sock.close()
        raise
