"""Which bytes go to which PS task: pull and push plans built from variables, without any I/O.

A PSClient validates what the caller passed and turns it into one request per PS task here, then hands
the plan to its TensorTransport (pscluster/net/transport.py). Everything in this module is plain Python over
numpy views, so it is tested without sockets.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from pscluster import codec
from pscluster.client.variables import ShardPlacement, Variable
from pscluster.errors import InvalidArgumentError
from pscluster.net.transport import PullPlan, PushPlan, ValueTargets
from pscluster.proto import pscluster_pb2 as pb
from pscluster.tables import TableConfig

Grads = Sequence[tuple[Variable, np.ndarray]]
Rows = Sequence[tuple[Variable, np.ndarray, np.ndarray]]  # (table, ids, rows or row gradients)
Scatter = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # (out, positions in out, received rows)


def check_variables(items: Sequence[Any], what: str) -> None:
    """Raise InvalidArgumentError unless every item is a Variable (a name or an array is a common slip)."""
    for i, item in enumerate(items):
        if not isinstance(item, Variable):
            raise InvalidArgumentError(
                f"{what}: item {i} is {type(item).__name__} {item!r:.60}, not a Variable; pass what "
                f"create_variable() returned (or client.variables()[name])")


def check_ids(var: Variable, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Row ids of table `var` as a 1-D int64 array, or InvalidArgumentError."""
    check_variables([var], "rows")
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{var.name}: row ids must be a 1-D integer array, got {arr.dtype}{arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{var.name}: key {int(arr.max())} does not fit int64 (keys are int64; "
                                   "reinterpret uint64 ids with ids.view(np.int64) if that is what you mean)")
    arr = arr.astype(np.int64, copy=False)
    if not var.shape:
        raise InvalidArgumentError(f"{var.name}: a scalar variable has no rows")
    if var.table:
        return arr  # any int64 is a key
    if arr.size and (arr.min() < 0 or arr.max() >= var.shape[0]):
        bad = arr[(arr < 0) | (arr >= var.shape[0])][0]
        raise InvalidArgumentError(f"{var.name}: row id {bad} outside [0, {var.shape[0]})")
    return arr


def as_grad(var: Variable, grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """grad as an array of `shape` in var's dtype (float64 numpy math into a float32 variable is common); a
    float16/bfloat16 gradient of a float32 variable stays half (mixed precision: the PS upcasts it)."""
    arr = np.asarray(grad)
    if var.dtype.kind == "f" and arr.dtype.kind in "biu":
        raise InvalidArgumentError(f"{var.name}: gradient dtype {arr.dtype} does not match variable dtype {var.dtype}")
    if arr.dtype != var.dtype and arr.dtype.kind == var.dtype.kind == "f" and not codec.half_of(var.dtype, arr.dtype):
        arr = arr.astype(var.dtype)
    if arr.shape != shape:
        raise InvalidArgumentError(f"{var.name}: gradient shape {arr.shape} does not match {shape}")
    return arr


def pull_plan(dense: Sequence[tuple[Variable, np.ndarray]], rows: Rows = ()) -> tuple[PullPlan, Scatter]:
    """One PullRequest's items per PS task, each with the view of `out` it fills, and the row parts that
    need a scatter copy afterwards (ids not sorted).

    Raises:
        InvalidArgumentError: not Variables, an `out` of the wrong shape, dtype or layout, bad ids.
    """
    check_variables([var for var, _ in dense], "pull")
    for var, _ in dense:
        if var.table:
            raise InvalidArgumentError(f"{var.name}: a dynamic table has no whole value; pull rows by key")
    checked = [(var, check_ids(var, ids), out) for var, ids, out in rows]
    for var, ids, out in [(v, None, o) for v, o in dense] + checked:
        want = var.shape if ids is None else (ids.size,) + var.shape[1:]
        if out.shape != want or out.dtype != var.dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError(f"{var.name}: pull target {out.dtype}{list(out.shape)} must be a writable "
                                       f"C-contiguous {var.dtype}{list(want)}")
    plan: PullPlan = defaultdict(list)
    for var, out in dense:
        for pl in var.shards:
            target = out[pl.row_offset:pl.row_offset + pl.rows] if var.shape else out
            plan[pl.ps].append((pb.PullItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index)), target))
    scatter: Scatter = []
    for var, ids, out in checked:
        for pl, sel in var.rows_by_shard(ids):
            if not sel.size:
                continue
            if sel[-1] - sel[0] + 1 == sel.size:  # a run of out's rows (sorted ids): receive in place
                run = slice(int(sel[0]), int(sel[-1]) + 1)
                part, part_ids = out[run], ids[run]
            else:
                part, part_ids = np.empty((sel.size,) + var.shape[1:], var.dtype), ids[sel]
                scatter.append((out, sel, part))
            plan[pl.ps].append((pb.PullItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index),
                                            ids=codec.encode(part_ids)), part))
    return plan, scatter


_DENSE_ITEMS: dict[tuple[int, np.dtype], tuple[Variable, list[tuple[ShardPlacement, pb.PushItem]]]] = {}
_DENSE_ITEMS_MAX = 1024  # variables remembered; a closure that makes new Variable objects each time refills it


def _dense_items(var: Variable, dtype: np.dtype) -> list[tuple[ShardPlacement, pb.PushItem]]:
    """Each shard's push item header (ref, dtype, shape) for a dense gradient of var in dtype.

    Why a cache: they never change for a variable, and building 3 messages per shard on every push was
    a tenth of a W2 worker's Python. Keyed by the Variable object (kept alive by its entry, so its id
    stays its own); the messages are copied into each request, never changed.
    """
    entry = _DENSE_ITEMS.get((id(var), dtype))
    if entry is not None and entry[0] is var:
        return entry[1]
    wire = var.dtype.str if dtype == var.dtype else codec.dtype_name(codec.wire_dtype(dtype))  # the PS checks it
    items = [(pl, pb.PushItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index),
                              grad=pb.Tensor(dtype=wire, shape=var.shard_shape(pl)))) for pl in var.shards]
    if len(_DENSE_ITEMS) >= _DENSE_ITEMS_MAX:
        _DENSE_ITEMS.clear()
    _DENSE_ITEMS[(id(var), dtype)] = (var, items)
    return items


def check_pairs(grads: Grads, rows: Rows = ()) -> list[tuple[Variable, np.ndarray]]:
    """grads as a list of (Variable, gradient) pairs, and rows' tables Variables, or InvalidArgumentError."""
    pairs = list(grads)
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
        raise InvalidArgumentError("push: takes (Variable, gradient) pairs")
    if not all(isinstance(row, tuple) and len(row) == 3 for row in rows):
        raise InvalidArgumentError("push: takes (table, ids, row gradients) triples as rows")
    check_variables([var for var, _ in pairs] + [var for var, _, _ in rows], "push")
    return pairs


def skip_plan(variables: Sequence[Variable]) -> PushPlan:
    """Items naming every shard of variables with an empty gradient: a sync step's skip (skip_step)."""
    plan: PushPlan = defaultdict(list)
    for var in dict.fromkeys(variables):
        for pl in var.shards:
            plan[pl.ps].append((pb.PushItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index),
                                            grad=codec.header(var.dtype, (0,))), np.empty(0, var.dtype)))
    return plan


def push_plan(grads: Grads, rows: Rows = (), with_values: bool = False
              ) -> tuple[PushPlan, ValueTargets, dict[str, np.ndarray]]:
    """One PushRequest's items per PS task with their gradient parts (each item's `grad` holds the part's
    dtype and shape, no data); with_values (fused push-pull, dense
    only) also allocates each variable's value array and the per-shard views of it the replies fill.

    Raises:
        InvalidArgumentError: not (Variable, gradient) pairs, a gradient of the wrong shape, bad ids.
    """
    pairs = check_pairs(grads, rows)
    values: dict[str, np.ndarray] = {}
    targets: ValueTargets = defaultdict(list)
    plan: PushPlan = defaultdict(list)
    for var, grad in pairs:
        if var.table:
            raise InvalidArgumentError(f"{var.name}: a dynamic table takes row gradients by key (push_rows)")
        arr = as_grad(var, grad, var.shape)
        value = None
        if with_values:
            value = values.get(var.name)
            if value is None:
                value = values[var.name] = np.empty(var.shape, var.dtype)
        for pl, item in _dense_items(var, arr.dtype):
            part = arr[pl.row_offset:pl.row_offset + pl.rows] if var.shape else arr
            plan[pl.ps].append((item, part))
            if value is not None:
                targets[pl.ps].append(value[pl.row_offset:pl.row_offset + pl.rows] if var.shape else value)
    for var, ids, row_grads in rows:
        ids = check_ids(var, ids)
        arr = as_grad(var, row_grads, (ids.size,) + var.shape[1:])
        for pl, part_ids, part in var.row_parts(ids, arr):
            plan[pl.ps].append((pb.PushItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index),
                                            ids=codec.encode(part_ids), grad=codec.header(part.dtype, part.shape)),
                                part))
    return plan, targets, values


@functools.lru_cache(maxsize=256)
def _refuses(table_json: str) -> bool:
    """Whether a dynamic table's config (its JSON, parsed once) refuses new keys at capacity."""
    return TableConfig.from_json(table_json).on_full == "refuse"


def room_checks(plan: PushPlan, rows: Rows, push_id: str) -> list[tuple[int, str, pb.RoomRequest]]:
    """CheckRoom calls to send before a push plan that reaches several PS tasks and carries keys of a
    dynamic table with on_full="refuse": one per PS task holding such keys ([] when none is needed)."""
    if len(plan) < 2:
        return []  # one PS task: its store applies a request all or nothing by itself
    refusing = {var.name for var, _, _ in rows if var.table and _refuses(var.table)}
    calls = []
    for ps, items in plan.items():
        check = [pb.PullItem(ref=item.ref, ids=item.ids) for item, _ in items if item.ref.variable in refusing]
        if check:
            calls.append((ps, "CheckRoom", pb.RoomRequest(items=check, push_id=push_id)))
    return calls
