"""Variable handles: picklable descriptions of a (possibly sharded) variable, with pull/push.

    w = coordinator.create_variable("w", initial_value=np.zeros((784, 10), np.float32),
                                    optimizer=SGD(0.5))
    def step(it):
        x, y = next(it)
        grad = compute(w.pull(), x, y)     # parallel pull of every shard, reassembled
        w.push(grad)                       # split per shard, applied by the PS's optimizer
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from pscluster.closures import pickle_by_reference
from pscluster.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from pscluster.optimizer_config import OptimizerConfig
from pscluster.tables import shard_of


@dataclass(frozen=True)
class ShardPlacement:
    """Where one shard lives: its index, PS task, and rows [row_offset, row_offset + rows)."""

    shard_index: int
    ps: int
    row_offset: int
    rows: int
    ordinal: int


@pickle_by_reference
@dataclass(frozen=True)
class Variable:
    """A handle on a variable held by the PS tasks. Safe to capture in closures."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: tuple[ShardPlacement, ...]
    sparse: bool = False
    table: str = ""  # a hash-keyed dynamic table (shape (0, dim) here): its TableConfig as JSON

    @property
    def dynamic(self) -> bool:
        """Whether this is a hash-keyed dynamic table (rows keyed by any int64, placed by key hash)."""
        return bool(self.table)

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        """Size of the whole variable in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def shard_shape(self, placement: ShardPlacement) -> tuple[int, ...]:
        """Shape of one shard."""
        return (placement.rows,) + self.shape[1:] if self.shape else ()

    def rows_by_shard(self, ids: np.ndarray) -> list[tuple[ShardPlacement, np.ndarray]]:
        """(shard, positions in `ids` of the rows it holds) for every shard; ids are global row numbers,
        or a dynamic table's keys (placed by their stable hash)."""
        if self.table:
            which = shard_of(ids, len(self.shards))
            return [(pl, np.flatnonzero(which == k)) for k, pl in enumerate(self.shards)]
        starts = np.array([pl.row_offset for pl in self.shards])
        which = np.searchsorted(starts, ids, side="right") - 1
        return [(pl, np.flatnonzero(which == k)) for k, pl in enumerate(self.shards)]

    def dense_parts(self, grad: np.ndarray) -> list[tuple[ShardPlacement, np.ndarray]]:
        """A dense gradient of the whole variable split into one part per shard."""
        return [(pl, grad[pl.row_offset:pl.row_offset + pl.rows] if self.shape else grad) for pl in self.shards]

    def row_parts(self, ids: np.ndarray, grads: np.ndarray) -> list[tuple[ShardPlacement, np.ndarray, np.ndarray]]:
        """Row gradients split into (shard, its ids, their gradients) for *every* shard, empty where it
        holds none of the rows: each shard then counts every update of the variable, so Adam's step
        (bias correction) does not depend on the partitioning (see server/optimizers.py).
        """
        parts = []
        for pl, sel in self.rows_by_shard(ids):
            if sel.size and sel[-1] - sel[0] + 1 == sel.size:  # a run (sorted ids): views, not copies
                run = slice(int(sel[0]), int(sel[-1]) + 1)
                parts.append((pl, ids[run], grads[run]))
            else:
                parts.append((pl, ids[sel], grads[sel]))
        return parts

    def pull(self) -> np.ndarray:
        """The current value, every shard pulled in parallel and reassembled."""
        if self.table:
            raise InvalidArgumentError(f"{self.name}: a dynamic table has no whole value; use pull_rows(keys)")
        return current_client().pull([self])[0]

    def read_value(self) -> np.ndarray:
        """Alias of pull(), as TF's Variable.read_value."""
        return self.pull()

    def numpy(self) -> np.ndarray:
        """Alias of pull(), as TF's Variable.numpy."""
        return self.pull()

    def push(self, grad: np.ndarray) -> list[int]:
        """Send a dense gradient; the PS applies it with this variable's optimizer. Returns shard versions."""
        return current_client().push([(self, grad)])

    def pull_rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `ids` (int64) of an embedding table."""
        return current_client().pull_rows(self, ids)

    def push_rows(self, ids: Sequence[int] | np.ndarray, grads: np.ndarray) -> list[int]:
        """Row gradients for rows `ids`; only those rows (and their slots) change."""
        return current_client().push_rows(self, ids, grads)


def pull(variables: Sequence[Variable]) -> list[np.ndarray]:
    """Pull several variables at once: one request per PS task, all in parallel."""
    return current_client().pull(variables)


def push(grads: Sequence[tuple[Variable, np.ndarray]], *, nonfinite: str | None = None,
         max_norm: float | None = None, norm_type: float = 2.0) -> list[int]:
    """Push gradients of several variables at once (one push id, one request per PS task); a NaN or Inf
    refuses the whole push ("reject", the default) or skips it ("skip"), max_norm clips them together
    by their global norm first (see PSClient.push)."""
    return current_client().push(grads, nonfinite=nonfinite, max_norm=max_norm, norm_type=norm_type)


def unique_rows(name: str, ids: np.ndarray, rows: int) -> np.ndarray:
    """Sorted unique int64 ids of a batch for table `name` of `rows` rows (the rows a step pulls).

    Raises:
        InvalidArgumentError: non-integer ids, or ids outside [0, rows).
    """
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name}: ids must be integers, got {arr.dtype}")
    arr = np.unique(arr.astype(np.int64, copy=False).reshape(-1))
    if arr.size and (arr[0] < 0 or arr[-1] >= rows):
        bad = arr[0] if arr[0] < 0 else arr[-1]
        raise InvalidArgumentError(f"{name}: id {bad} outside the table's rows [0, {rows})")
    return arr


def check_table_ids(tables: Sequence[str], given: Sequence[str]) -> None:
    """A model adapter's pull(ids=...) names exactly its sparse tables.

    Raises:
        InvalidArgumentError: ids for a name that is no table, or a table without ids.
    """
    unknown, missing = sorted(set(given) - set(tables)), sorted(set(tables) - set(given))
    if unknown or missing:
        raise InvalidArgumentError(f"pull(ids=...): sparse tables are {sorted(tables)}; got ids for unknown "
                                   f"{unknown} and none for {missing}")


class Backend(Protocol):
    """What handles and adapters need of a PS client (PSClient is the one implementation)."""

    def pull(self, variables: Sequence[Variable]) -> list[np.ndarray]:
        """Current values of variables."""

    def pull_into(self, dense: Sequence[tuple[Variable, np.ndarray]],
                  rows: Sequence[tuple[Variable, np.ndarray, np.ndarray]] = ()) -> None:
        """Fill arrays in place with whole variables and table rows."""

    def pull_rows(self, var: Variable, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows ids of a table."""

    def push(self, grads: Sequence[tuple[Variable, np.ndarray]], push_id: str | None = None, step: int = 0,
             rows: Sequence[tuple[Variable, np.ndarray, np.ndarray]] = (), *, nonfinite: str | None = None,
             max_norm: float | None = None, norm_type: float = 2.0, unclipped: int = 0) -> list[int]:
        """Dense and row gradients under one push id, checked for NaN/Inf and clipped first; the new
        shard versions ([] for a skipped step)."""

    def push_rows(self, var: Variable, ids: Sequence[int] | np.ndarray, grads: np.ndarray,
                  push_id: str | None = None, step: int = 0) -> list[int]:
        """Row gradients of a table."""

    def take_token(self, closure_id: int, worker: str, timeout: float = 30.0) -> tuple[int, int]:
        """A sync token (step, replica) from PS 0's queue."""


_default_client: Backend | None = None
_thread = threading.local()  # .client: the running closure's client, set by its ClosureScope


def set_default_client(client: Backend | None) -> None:
    """Make client the process's default (the coordinator's or the worker's)."""
    global _default_client
    _default_client = client


def set_thread_client(client: Backend | None) -> Backend | None:
    """Make client this thread's (a closure's scope does); returns the one it replaces."""
    previous: Backend | None = getattr(_thread, "client", None)
    _thread.client = client
    return previous


def current_client() -> Backend:
    """The PS client for this thread: the closure's, else the process default.

    Raises:
        FailedPreconditionError: no client in this process.
    """
    client = getattr(_thread, "client", None) or _default_client
    if client is None:
        raise FailedPreconditionError(
            "no PS client in this process: create a ClusterCoordinator or PSClient first")
    return client


def refuse_redefinition(existing: Variable, existing_optimizer: OptimizerConfig | None, shape: tuple[int, ...],
                        dtype: np.dtype, table: str, shards: int, optimizer: OptimizerConfig) -> None:
    """AlreadyExistsError unless create_variable(shape, dtype, table, shards, optimizer) re-creates `existing`,
    whose optimizer is existing_optimizer (None: not known here); the hyper-parameters a driver may change while
    training may differ (`OptimizerConfig.structure`), and a dynamic table made with one shard per PS task keeps
    the count it was saved with when a checkpoint is restored onto another number of tasks (shards 0: any)."""
    if existing.shape != shape or existing.dtype != dtype or existing.table != table or \
            (shards and len(existing.shards) != shards):
        raise AlreadyExistsError(
            f"variable {existing.name!r} exists as {existing.dtype}{list(existing.shape)} in "
            f"{existing.num_shards} shard(s); cannot redefine it as {dtype}{list(shape)} in {shards or 'any'}")
    if existing_optimizer is not None and existing_optimizer.structure() != optimizer.structure():
        raise AlreadyExistsError(
            f"variable {existing.name!r} exists with optimizer {_optimizer_words(existing_optimizer, optimizer)}; "
            f"cannot re-create it with {_optimizer_words(optimizer, existing_optimizer)} (nothing changed)")


def _optimizer_words(opt: OptimizerConfig, other: OptimizerConfig) -> str:
    """opt's kind, and the structural fields in which it differs from other."""
    mine, theirs = opt.structure(), other.structure()
    names = [f.name for f in fields(mine) if f.name != "kind" and getattr(mine, f.name) != getattr(theirs, f.name)]
    if opt.kind != other.kind or not names:
        return repr(opt.kind)
    return f"{opt.kind!r} ({', '.join(f'{n}={getattr(opt, n)!r}' for n in names)})"


def missing_here(ps: int, calls: Sequence[tuple[int, str, Any]], held: set[tuple[str, int]],
                 primaries: dict[tuple[str, int], int] | None) -> list[tuple[int, str, Any]]:
    """Of a client's CreateShard calls (placement PS, method, request), those to send PS `ps` again (it restarted
    from a checkpoint older than them): the shards it does not hold whose primary it is now (`primaries`, the
    replica table: a shard a scale moved off its placement PS is not made again there, where nothing routes to
    it or saves it; one it backs up comes whole from its primary), else (no table, or no row yet) whose
    placement it is."""
    out = []
    for placed, method, request in calls:
        key = (request.spec.variable, request.spec.shard_index)
        home = placed if primaries is None else primaries.get(key, placed)
        if home == ps and key not in held:
            out.append((ps, method, request))
    return out
