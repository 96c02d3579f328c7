"""Per-worker datasets, as TF's `create_per_worker_dataset`: each worker builds its own iterator.

    ds = coordinator.create_per_worker_dataset(lambda ctx: batches(shard=ctx.worker_index))
    it = iter(ds)                       # a handle; pass it to closures
    coordinator.schedule(step, args=(it,))
    # in the closure, next(it) draws from *this worker's* iterator, built on first use and rebuilt
    # on a replacement worker.

As in TF, every `iter(ds)` is a fresh iterator (an epoch): each worker builds a new one from the
dataset function on first use. A worker keeps its `MAX_ITERATORS` most recently used iterators; an
older one that is used again starts over. `ds.skip(n)` is the same dataset with each worker's iterator
starting after its first n elements (tf.data's `skip`, per worker): a resumed fit draws from there, not
from the batches the killed run's closures already trained on.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from pscluster.client import context
from pscluster.closures import pickle_by_reference, ship_user_modules
from pscluster.errors import FailedPreconditionError, InvalidArgumentError

MAX_ITERATORS = 64  # per worker process: an epoch's iterator each, so a long run's epochs do not pile up


@dataclass(frozen=True)
class WorkerInfo:
    """What a dataset function learns about the worker it runs on."""

    worker_id: str
    worker_index: int


class PerWorkerDataset:
    """A dataset function to be called on each worker; `iter()` gives a closure-passable handle."""

    def __init__(self, fn: Callable[..., Any], skipped: int = 0, fn_bytes: bytes | None = None) -> None:
        self.fn = fn
        self.skipped = skipped
        self.dataset_id = uuid.uuid4().hex
        self._epochs = itertools.count()
        if fn_bytes is None:
            ship_user_modules()
            fn_bytes = cloudpickle.dumps(fn)  # once: the handle travels with every closure
        self.fn_bytes = fn_bytes

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(f"{self.dataset_id}/{next(self._epochs)}", self.fn_bytes, self.skipped)

    def skip(self, count: int) -> PerWorkerDataset:
        """This dataset with each worker's iterator starting after its first `count` elements (drawn and dropped
        on the worker when the iterator is built).

        Raises:
            InvalidArgumentError: count is not an int >= 0.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidArgumentError(f"skip: count={count!r}; must be an int >= 0")
        return PerWorkerDataset(self.fn, self.skipped + count, self.fn_bytes)


def _iterator(iterator_id: str, fn_bytes: bytes, skipped: int = 0) -> PerWorkerIterator:
    return PerWorkerIterator(iterator_id, fn_bytes, skipped)


@pickle_by_reference
class PerWorkerIterator:
    """Handle on the running worker's iterator of a PerWorkerDataset (pickles as id + function bytes)."""

    def __init__(self, iterator_id: str, fn_bytes: bytes, skipped: int = 0) -> None:
        self.iterator_id = iterator_id
        self.fn_bytes = fn_bytes
        self.skipped = skipped

    def __reduce__(self) -> tuple[Any, tuple[str, bytes, int]]:
        return _iterator, (self.iterator_id, self.fn_bytes, self.skipped)

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        scope = context.current_scope()
        if scope is None or scope.worker is None:
            raise FailedPreconditionError("a per-worker iterator can only be used inside a scheduled closure")
        return next(scope.worker.iterator(self.iterator_id, self.fn_bytes, self.skipped))


class _LockedIterator:
    """An iterator several closures on one worker may draw from at once (generators may not)."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._lock = threading.Lock()

    def __iter__(self) -> _LockedIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


class WorkerDatasets:
    """The iterators one worker process has built, by dataset id."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self._iterators: OrderedDict[str, _LockedIterator] = OrderedDict()
        self._lock = threading.Lock()

    def iterator(self, iterator_id: str, fn_bytes: bytes, skipped: int = 0) -> Iterator[Any]:
        """This worker's iterator for iterator_id, built once on first use (the oldest beyond MAX_ITERATORS go),
        past its first `skipped` elements."""
        with self._lock:
            it = self._iterators.get(iterator_id)
            if it is None:
                fn = cloudpickle.loads(fn_bytes)
                takes_ctx = bool(inspect.signature(fn).parameters)
                it = _LockedIterator(itertools.islice(fn(self.info) if takes_ctx else fn(), skipped, None))
                self._iterators[iterator_id] = it
                while len(self._iterators) > MAX_ITERATORS:
                    self._iterators.popitem(last=False)
            else:
                self._iterators.move_to_end(iterator_id)
        return it
