"""How a shard's whole state reaches a backup (replicas: 2): whole, or a bounded chunk of rows at a time.

The primary copies chunk i (rows [start, end) of the value and of every slot) under the shard's lock at the
version current then, queues it, and copies the next one only once the backup confirmed it
(server/replicator.py): the primary holds one chunk per shard, never a copy of the shard, and no frame
carries more than a chunk, so a shard larger than max_tensor_bytes catches up too. Updates made between
two chunks travel between them in the stream, as always. The backup stages the chunks outside its store and
applies each update to the rows it holds so far: every optimizer kernel is elementwise (a slot has the
value's shape), so an update applies to a row range as to the whole, and each chunk arrives at the version
the staged rows have reached. The staged copy, installed with the last chunk, is the primary's state at one
version. A dynamic table's state (hash index, admission) is not cut in rows: it goes whole, as does a
state that fits one chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import table_state
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.push_record import PushKey, PushRecord
from pscluster.server.store import Key, Shard, VariableStore, shard_name

from pscluster import codec
from pscluster.specs import spec_from_pb
from pscluster.tables import TableConfig

CHUNK_BYTES = 8 << 20  # value and slot bytes per chunk (bounded further by the frame limits: server/main.py)
TABLE = "table/"  # a dynamic table's state arrays ride in an install's slots under this prefix


def whole(f: pb.ReplicaForward, tensors: list[np.ndarray], owned: bool, dedup_window: int) -> Shard:
    """The shard a whole-state install describes (not in the store yet); owned: the received buffers become
    the shard (a catch-up costs the backup 1x its state, not 2x)."""
    spec = spec_from_pb(f.spec)
    value = tensors[0] if owned else np.array(tensors[0], copy=True)
    slots = {name: t if owned else np.array(t, copy=True) for name, t in zip(sorted(f.slots), tensors[1:])}
    record = PushRecord.from_state(json.loads(f.record) if f.record else {}, dedup_window, f.version)
    table = None
    if spec.table:
        table = DynamicTable(TableConfig.from_json(spec.table), spec.optimizer, shard_name(spec))
        table_state.load(table, {k[len(TABLE):]: v for k, v in slots.items() if k.startswith(TABLE)})
        slots = {}
    return Shard(spec, value, slots, f.version, record=record, table=table)


def rows_per_chunk(shard: Shard, chunk_bytes: int) -> int | None:
    """Rows per chunk of shard's state; None when it goes whole (a table, a scalar, or it fits one chunk)."""
    value = shard.value
    if shard.table is not None or value.ndim == 0 or value.shape[0] < 2:
        return None
    state_bytes = value.nbytes * (1 + len(shard.slots))
    if state_bytes <= chunk_bytes:
        return None
    row_bytes = max(1, state_bytes // int(value.shape[0]))
    return max(1, int(chunk_bytes // row_bytes))


def chunk(shard: Shard, start: int, rows: int, msg: pb.ReplicaForward) -> list[np.ndarray]:
    """Under the shard's lock: fill msg (an install with spec, epoch, version) with rows [start, start + rows)
    of the state, and return their copies in `tensors_of` order (value, then the slots by name)."""
    end = min(start + rows, shard.value.shape[0])
    msg.chunk_start = start
    msg.chunk_more = end < shard.value.shape[0]
    arrays = [np.array(shard.value[start:end], copy=True)]
    msg.value.CopyFrom(codec.header(arrays[0].dtype, arrays[0].shape))
    for name in sorted(shard.slots):
        arrays.append(np.array(shard.slots[name][start:end], copy=True))
        msg.slots[name].CopyFrom(codec.header(arrays[-1].dtype, arrays[-1].shape))
    if start == 0:
        msg.record = json.dumps(shard.record.state())
    return arrays


@dataclass
class Staged:
    """A backup's copy of a shard being caught up in chunks: full-size arrays, the first `rows` rows filled and
    brought to `shard.version`; not in the store until its last chunk."""

    shard: Shard
    rows: int
    epoch: int


class Stager:
    """A backup's catch-ups in chunks under way, by shard (each shard's forwards come one at a time)."""

    def __init__(self, dedup_window: int) -> None:
        self._dedup_window = dedup_window
        self._staged: dict[Key, Staged] = {}

    def get(self, key: Key) -> Staged | None:
        """Key's catch-up under way, if any."""
        return self._staged.get(key)

    def drop(self, key: Key) -> None:
        """Forget key's catch-up under way (a whole install replaced it)."""
        self._staged.pop(key, None)

    def take(self, f: pb.ReplicaForward, key: Key,
             tensors: list[np.ndarray]) -> tuple[Literal["applied", "held", "gap"], Shard | None, bool]:
        """A chunk: (its outcome, the staged copy, whether it is complete: the caller installs it)."""
        staged = self._staged.get(key)
        if f.chunk_start == 0:  # a first chunk (or its resend: the updates after it come again too)
            staged = self._staged[key] = begin(f, tensors, self._dedup_window)
        elif staged is None:
            return "gap", None, False  # its first chunk is missing (this PS restarted)
        else:
            done = add(staged, f, tensors)
            if done != "applied":
                return done, staged.shard, False
        if f.chunk_more:
            return "applied", staged.shard, False
        del self._staged[key]
        return "applied", staged.shard, True


def begin(f: pb.ReplicaForward, tensors: list[np.ndarray], dedup_window: int) -> Staged:
    """Stage the first chunk of an install: the arrays at the shard's full shape, its first rows filled."""
    spec = spec_from_pb(f.spec)
    value = np.empty(spec.shape, tensors[0].dtype)
    slots = {name: np.empty(spec.shape, t.dtype) for name, t in zip(sorted(f.slots), tensors[1:])}
    record = PushRecord.from_state(json.loads(f.record) if f.record else {}, dedup_window, f.version)
    staged = Staged(Shard(spec, value, slots, f.version, record=record), 0, f.epoch)
    _fill(staged, tensors)
    return staged


def add(staged: Staged, f: pb.ReplicaForward, tensors: list[np.ndarray]) -> Literal["applied", "held", "gap"]:
    """A later chunk: "held" for one staged already (a resend), "gap" for one beyond the next or made at a
    version the staged rows have not reached (the backup needs the state again from its first chunk)."""
    if f.epoch != staged.epoch:
        return "gap"
    if f.chunk_start < staged.rows:
        return "held"
    if f.chunk_start > staged.rows or f.version != staged.shard.version:
        return "gap"
    _fill(staged, tensors)
    return "applied"


def _fill(staged: Staged, tensors: list[np.ndarray]) -> None:
    shard = staged.shard
    end = staged.rows + tensors[0].shape[0]
    if end > shard.value.shape[0] or any(t.shape[1:] != shard.value.shape[1:] for t in tensors):
        raise ValueError(f"{shard.name}: a catch-up chunk of shape {tensors[0].shape} does not fit rows "
                         f"[{staged.rows}, {shard.value.shape[0]}) of {shard.value.shape}")
    shard.value[staged.rows:end] = tensors[0]
    for name, t in zip(sorted(shard.slots), tensors[1:]):
        shard.slots[name][staged.rows:end] = t
    staged.rows = end


def apply_at(staged: Staged, shard: Shard, version: int, grad: np.ndarray, local: np.ndarray | None,
             key: PushKey | None, final_below: int) -> Literal["applied", "held", "gap"]:
    """An update (the primary's number `version`) to the staged rows, as VariableStore.apply_at to a shard
    (shard: staged.shard): rows not staged yet get it with their chunk, which is copied after it."""
    rows = staged.rows
    part = Shard(shard.spec, shard.value[:rows], {name: s[:rows] for name, s in shard.slots.items()},
                 shard.version, record=shard.record)
    if local is None:
        grad = grad[:rows]
    else:
        keep = local < rows
        grad, local = grad[keep], local[keep]
    done = VariableStore.apply_at(part, version, grad, local, key, final_below)
    shard.version = part.version
    return done
