"""Reused parts of what a primary forwards to its backup (replicas: 2): gradient copies and message templates.

A forward owns a copy of its gradient (the push's array is a view of a connection's buffer, which the next push
reuses). A fresh 400 KB allocation per push lands on memory that is cold in the cache: B15FLOOR measured
`np.array(grad, copy=True)` of W2's 784x128 gradient at ~170 us of CPU inside the push against ~25-45 us for
the same copy into a buffer used again each push. So dense gradients are copied into buffers kept here, one set
per shape. A buffer is free again once nothing else refers to it (the queue, a batch in flight, a send's views
and an in-process backup all hold references): no release call to miss on any of the replicator's paths (sent,
superseded, resent, refused), and a buffer something still holds is never handed out twice.

Where the copy lands matters as much: on this project's 2-core machine (AMD EPYC, glibc's memmove) a 400 KB copy
whose destination sits 4-28 bytes past its source modulo a 4 KiB page took 180-390 us, against 12-19 us at any
other distance (the buffer B15FLOOR's push used happened to sit 16 bytes past the gradient: 200-235 us per
push). Each copy therefore lands at its source's offset within the page (a kept buffer has a page of slack).
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import replica_wire

from pscluster import codec

MIN_BYTES = 64 << 10  # smaller copies: a plain np.array (a fresh small allocation costs little)
PER_SHAPE = 4  # buffers kept per size: a push in flight, one queued behind it, and room for others
MAX_BYTES = 64 << 20  # all buffers kept, per pool; past it copies are plain allocations again
PAGE = 4096  # a copy lands at its source's offset within a page of this size (see above)
_FREE_REFS = 3  # getrefcount of a kept buffer nothing else holds: the pool's list, the loop's name, the argument


class ForwardBuffers:
    """A bounded set of reusable buffers, per size, for the forwards' copies; thread-safe."""

    def __init__(self, per_shape: int = PER_SHAPE, max_bytes: int = MAX_BYTES) -> None:
        self._per_shape = per_shape
        self._max_bytes = max_bytes
        self._lock = threading.Lock()  # held for a scan of a few references, never across a copy
        self._kept: dict[int, list[np.ndarray]] = {}  # by size in bytes
        self.kept_bytes = 0

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of array that the caller owns until it drops every reference to it."""
        if array.nbytes < MIN_BYTES or not array.flags.aligned:
            return np.array(array, copy=True)
        raw = self._take(array.nbytes)
        if raw is None:
            return np.array(array, copy=True)
        start = (array.ctypes.data - raw.ctypes.data) % PAGE  # the source's offset in its page
        out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(out, array)
        return out

    def _take(self, nbytes: int) -> np.ndarray | None:
        """A kept byte buffer of nbytes and a page that nothing else holds (a new one while there is room)."""
        with self._lock:
            kept = self._kept.setdefault(nbytes, [])
            for raw in kept:
                if sys.getrefcount(raw) == _FREE_REFS:
                    return raw
            if len(kept) >= self._per_shape or self.kept_bytes + nbytes + PAGE > self._max_bytes:
                return None
            raw = np.empty(nbytes + PAGE, np.uint8)
            kept.append(raw)
            self.kept_bytes += raw.nbytes
            return raw

    def clear(self) -> None:
        """Let go of every kept buffer (those still in use stay with their holders)."""
        with self._lock:
            self._kept.clear()
            self.kept_bytes = 0


MAX_TEMPLATES = 4096  # dense (shard, dtype, shape) forward templates kept; past it the set starts over


class ForwardTemplates:
    """A dense forward's constant part (its shard's ref and the gradient's header), built once per shard.

    Built per push, pb.ReplicaForward with a ShardRef and a Tensor header cost ~10 us (4 per W2 push); a copy of
    a kept template with the per-push fields set costs ~2 us. Each template comes with the same constant part
    in server/replica_wire.py's compact form. Thread-safe: a race builds a template twice.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int, np.dtype, tuple[int, ...]], tuple[pb.ReplicaForward, bytes]] = {}

    def forward(self, variable: str, shard_index: int, grad: np.ndarray) -> tuple[pb.ReplicaForward, bytes]:
        """A new forward of a dense gradient of grad's dtype and shape (ref and grad set, the rest unset), and
        its constant part in the compact form."""
        key = (variable, shard_index, grad.dtype, grad.shape)
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) >= MAX_TEMPLATES:
                self._kept = {}
            kept = (pb.ReplicaForward(ref=pb.ShardRef(variable=variable, shard_index=shard_index),
                                      grad=codec.header(grad.dtype, grad.shape)),
                    replica_wire.const_part(variable, shard_index, grad.dtype, grad.shape))
            self._kept[key] = kept
        msg = pb.ReplicaForward()
        msg.CopyFrom(kept[0])
        return msg, kept[1]
