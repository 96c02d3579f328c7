"""Serialized closures: each function is pickled once, its arguments on every call.

cloudpickle of a function defined in a script (by value: code, globals, closure cells) costs
milliseconds; a training loop schedules the same step function thousands of times. As TF traces a
`tf.function` once, `ClosureEncoder` pickles a function the first time it is scheduled and reuses the
bytes (its captured objects are snapshotted then: pass values that change as arguments).
`FunctionCache` on the worker unpickles each digest once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import cloudpickle

from pscluster.errors import InvalidArgumentError
from pscluster.proto import pscluster_pb2 as pb


class ClosureEncoder:
    """Builds ClosurePayload bytes; caches each function's pickle by identity."""

    def __init__(self, max_functions: int = 1024) -> None:
        self._cache: OrderedDict[int, tuple[Callable[..., Any], str, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_functions

    def encode(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        """The payload for fn(*args, **kwargs)."""
        if not callable(fn):
            raise InvalidArgumentError(f"schedule needs a callable, got {type(fn).__name__}")
        with self._lock:
            hit = self._cache.get(id(fn))
            if hit is not None and hit[0] is fn:
                self._cache.move_to_end(id(fn))
                digest, blob = hit[1], hit[2]
            else:
                blob = cloudpickle.dumps(fn)
                digest = hashlib.sha256(blob).hexdigest()
                self._cache[id(fn)] = (fn, digest, blob)  # holding fn keeps its id from being reused
                while len(self._cache) > self._max:
                    self._cache.popitem(last=False)
        arguments = cloudpickle.dumps((tuple(args), dict(kwargs)))
        return pb.ClosurePayload(digest=digest, function=blob, arguments=arguments).SerializeToString()


class FunctionCache:
    """Worker side: digest -> function, unpickled once (LRU)."""

    def __init__(self, max_functions: int = 256) -> None:
        self._cache: OrderedDict[str, Callable[..., Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_functions

    def decode(self, payload: bytes) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """(fn, args, kwargs) from payload bytes."""
        msg = pb.ClosurePayload()
        msg.ParseFromString(payload)
        with self._lock:
            fn = self._cache.get(msg.digest)
            if fn is not None:
                self._cache.move_to_end(msg.digest)
        if fn is None:
            if hashlib.sha256(msg.function).hexdigest() != msg.digest:
                raise InvalidArgumentError("closure payload: function bytes do not match their digest")
            fn = cloudpickle.loads(msg.function)
            with self._lock:
                self._cache[msg.digest] = fn
                while len(self._cache) > self._max:
                    self._cache.popitem(last=False)
        args, kwargs = cloudpickle.loads(msg.arguments)
        return fn, args, kwargs
