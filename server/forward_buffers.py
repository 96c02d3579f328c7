"""Reused buffers for the copies a primary forwards to its backup (replicas: 2).

A forward owns a copy of its gradient (the push's array is a view of a connection's buffer, which the next push
reuses). A fresh 400 KB allocation per push lands on memory that is cold in the cache: B15FLOOR measured
`np.array(grad, copy=True)` of W2's 784x128 gradient at ~170 us of CPU inside the push against ~25-45 us for
the same copy into a buffer used again each push. So dense gradients are copied into buffers kept here, one set
per shape. A buffer is free again once nothing else refers to it (the queue, a batch in flight, a send's views
and an in-process backup all hold references): no release call to miss on any of the replicator's paths (sent,
superseded, resent, refused), and a buffer something still holds is never handed out twice.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_BYTES = 64 << 10  # smaller copies: a plain np.array (a fresh small allocation costs little)
PER_SHAPE = 4  # buffers kept per (dtype, shape): a push in flight, one queued behind it, and room for others
MAX_BYTES = 64 << 20  # all buffers kept, per pool; past it copies are plain allocations again
_FREE_REFS = 3  # getrefcount of a kept buffer nothing else holds: the pool's list, the loop's name, the argument


class ForwardBuffers:
    """A bounded set of reusable arrays, per (dtype, shape), for the forwards' copies; thread-safe."""

    def __init__(self, per_shape: int = PER_SHAPE, max_bytes: int = MAX_BYTES) -> None:
        self._per_shape = per_shape
        self._max_bytes = max_bytes
        self._lock = threading.Lock()  # held for a scan of a few references, never across a copy
        self._kept: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
        self.kept_bytes = 0

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of array that the caller owns until it drops every reference to it."""
        if array.nbytes < MIN_BYTES:
            return np.array(array, copy=True)
        out = self._take(array.dtype, array.shape)
        if out is None:
            return np.array(array, copy=True)
        np.copyto(out, array)
        return out

    def _take(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        key = (dtype.str, shape)
        with self._lock:
            kept = self._kept.setdefault(key, [])
            for buf in kept:
                if sys.getrefcount(buf) == _FREE_REFS:
                    return buf
            nbytes = int(np.prod(shape)) * dtype.itemsize
            if len(kept) >= self._per_shape or self.kept_bytes + nbytes > self._max_bytes:
                return None
            buf = np.empty(shape, dtype)
            kept.append(buf)
            self.kept_bytes += nbytes
            return buf

    def clear(self) -> None:
        """Let go of every kept buffer (those still in use stay with their holders)."""
        with self._lock:
            self._kept.clear()
            self.kept_bytes = 0
