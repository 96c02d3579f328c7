"""Same-host payloads: a shared-memory segment per framed connection, as ps-lite's IPC van does.

A W2 step moves ~400 KB of gradients and ~400 KB of values through loopback TCP, and the kernel's
copies and segment processing cost the sender ~130 us and the receiver ~65 us per 400 KB even warm
(more in a busy cluster), against ~16 us for one memory copy. So when a bulk client and its PS share a
host, the connection's payloads go through a file under /dev/shm that both map, and the socket
carries only the frame headers.

The client creates the segment (0600, `O_EXCL`), writes a random nonce at its start and asks the PS
to attach. The PS maps it only if it can open it and reads the same nonce, which proves a shared
filesystem and host (a remote PS, or one in another container, cannot); then both ends unlink the
name, so nothing is left behind when either dies. A request or reply uses the segment only if it
fits; anything else, and every connection with TLS, stays on the socket, as does everything when the
segment cannot be allocated (a container's small /dev/shm). Requests on a connection
are sequential, so one region serves both directions. The PS copies a pushed payload out before it
validates it, so the client cannot change a gradient between validation and apply.

Trust: a peer that can open the client's 0600 file runs as the same user on the same host, and
could signal the PS anyway; shrinking the file under the PS's mapping (SIGBUS) grants it nothing new.
"""

from __future__ import annotations

import ipaddress
import mmap
import os
import secrets
import socket
from collections.abc import Callable, Sequence

import numpy as np

from pscluster.errors import FailedPreconditionError
from pscluster.net.framing import send_frame
from pscluster.proto import pscluster_pb2 as pb

DIRECTORY = "/dev/shm"
PREFIX = "pscluster-"
HEADER_BYTES = 64  # the nonce, padded so the region starts cache-line aligned
NONCE_BYTES = 16
MIN_BYTES = 64 << 10  # below this a payload rides the socket: one copy more or less is not worth a segment
MAX_BYTES = 64 << 20  # per connection (a worker holds one per PS connection); larger payloads ride the socket


def available() -> bool:
    """Whether this host has a shared-memory filesystem to put segments in."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


def is_local_peer(conn: socket.socket) -> bool:
    """Whether conn's peer address is a loopback address (the only peers offered a segment)."""
    try:
        return ipaddress.ip_address(conn.getpeername()[0]).is_loopback
    except (OSError, ValueError):
        return False


def size_for(nbytes: int) -> int:
    """Segment size for payloads of nbytes: the next power of two (growth re-attaches rarely)."""
    return HEADER_BYTES + (1 << max(nbytes - 1, MIN_BYTES - 1).bit_length())


class Segment:
    """One connection's payload region, mapped by both ends."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._map = mapping
        self.region = np.frombuffer(mapping, np.uint8, offset=HEADER_BYTES)

    @property
    def capacity(self) -> int:
        """Payload bytes the region holds."""
        return int(self.region.size)

    @classmethod
    def create(cls, size: int) -> tuple[Segment, bytes]:
        """A new segment of size bytes (client side) and the nonce written at its start."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.open(os.path.join(DIRECTORY, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # allocated now, not on first touch: a full /dev/shm (a container's 64 MiB default) must be an
            # error here, not a SIGBUS when a payload is copied in
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(os.path.join(DIRECTORY, name))
            raise
        finally:
            os.close(fd)
        mapping[:NONCE_BYTES] = nonce
        return cls(name, mapping), nonce

    @classmethod
    def attach(cls, name: str, nonce: bytes, size: int, max_bytes: int) -> Segment:
        """The client's segment `name` (server side), after checking its size and nonce; the name is unlinked.

        Raises:
            FailedPreconditionError: no such segment here, or not the one offered (another host).
        """
        if not name.startswith(PREFIX) or os.sep in name or name in (".", ".."):
            raise FailedPreconditionError(f"shared-memory segment name {name!r} is not one of pscluster's")
        if not HEADER_BYTES < size <= HEADER_BYTES + max_bytes or len(nonce) != NONCE_BYTES:
            raise FailedPreconditionError(f"shared-memory segment of {size} bytes is outside 1..{max_bytes}")
        path = os.path.join(DIRECTORY, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise FailedPreconditionError(f"shared-memory segment {name}: {exc.strerror}") from exc
        try:
            if os.fstat(fd).st_size != size:
                raise FailedPreconditionError(f"shared-memory segment {name} is not {size} bytes")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mapping[:NONCE_BYTES] != nonce:
            mapping.close()
            raise FailedPreconditionError(f"shared-memory segment {name} is another host's")
        unlink(name)
        return cls(name, mapping)

    def write(self, arrays: Sequence[np.ndarray]) -> None:
        """arrays' bytes into the region, one after another (they must fit)."""
        offset = 0
        for array in arrays:
            n = array.nbytes
            self.region[offset:offset + n] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            offset += n

    def read_into(self, targets: Sequence[np.ndarray]) -> None:
        """The region's bytes into targets (C-contiguous), one after another."""
        offset = 0
        for target in targets:
            n = target.nbytes
            target.reshape(-1).view(np.uint8)[:] = self.region[offset:offset + n]
            offset += n

    def close(self) -> None:
        """Unmap (the region's views must be gone); a second call does nothing."""
        if "region" not in self.__dict__:
            return
        del self.region
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


def offer(sock: socket.socket, nbytes: int,
          read_reply: Callable[[], tuple[pb.BulkReply, int]]) -> Segment | None:
    """Offer the server behind sock (a connection between requests) a new segment for payloads of nbytes:
    the segment once attached, None when none could be made or the server declined it (another host, a
    server without segments): the connection then carries its payloads itself from now on.

    Raises:
        ConnectionError: the answer carried a payload (the stream is out of step).
    """
    try:
        segment, nonce = Segment.create(size_for(nbytes))
    except OSError:  # /dev/shm full or not writable
        return None
    try:
        request = pb.ShmAttach(name=segment.name, nonce=nonce, size=HEADER_BYTES + segment.capacity)
        send_frame(sock, pb.BulkRequest(shm_attach=request).SerializeToString())
        reply, payload_len = read_reply()
    except BaseException:
        segment.close()
        raise
    finally:
        unlink(segment.name)
    if payload_len or reply.code:
        segment.close()
        if payload_len:
            raise ConnectionError("a segment offer was answered with a payload")
        return None
    return segment


def sweep() -> list[str]:
    """Remove the segment files of pscluster processes that no longer run (a process SIGKILLed between creating
    a segment and its peer's attach leaves its name behind); the names removed. Called by a daemon as it starts."""
    try:
        names = os.listdir(DIRECTORY)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(PREFIX):].partition("-")[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _runs(int(pid)) and _owned(name):
            unlink(name)
            removed.append(name)
    return removed


def _runs(pid: int) -> bool:
    """Whether a process has this pid (another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owned(name: str) -> bool:
    """Whether segment file `name` belongs to this user."""
    try:
        return os.stat(os.path.join(DIRECTORY, name)).st_uid == os.getuid()
    except OSError:
        return False


def unlink(name: str) -> None:
    """Remove a segment's name (its memory lives until both ends unmap)."""
    try:
        os.unlink(os.path.join(DIRECTORY, name))
    except FileNotFoundError:
        pass
