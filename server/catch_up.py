"""How a shard's whole state reaches a backup (replicas: 2): whole, or a bounded chunk of rows at a time.

The primary copies chunk i (rows [start, end) of the value and of every slot) under the shard's lock at the
version current then, queues it, and copies the next one only once the backup confirmed it
(server/replicator.py): the primary holds one chunk per shard, never a copy of the shard, and no frame
carries more than a chunk, so a shard larger than max_tensor_bytes catches up too. Updates made between
two chunks travel between them in the stream, as always. The backup stages the chunks outside its store and
applies each update to the rows it holds so far: every optimizer kernel is elementwise (a slot has the
value's shape), so an update applies to a row range as to the whole, and each chunk arrives at the version
the staged rows have reached. The staged copy, installed with the last chunk, is the primary's state at one
version. A state that fits one chunk goes whole.

A dynamic table's state (hash index, admission) cannot take an update in part, so it is cut otherwise
(`table_chunks`): one snapshot under the shard's lock, cut into a first chunk (the admission filter, counters
and push record) and chunks of keys with their rows, slots and metadata, all queued back to back under that
lock (`Replicator.put_series`), so the updates and pulls that race the catch-up follow its last chunk. The
backup builds the table as the chunks come (keys inserted into its index, rows copied into its arrays), outside
its store, and installs it with the last chunk; a forward of the shard that arrives while it is staged is out
of order (GAP: the state is sent again), never applied to half a table.
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
from pscluster.errors import InvalidArgumentError
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
    """Rows per chunk of shard's state; None when it goes whole (a scalar, or it fits one chunk) or is a
    table (cut by keys: `table_chunks`)."""
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


Chunk = tuple[pb.ReplicaForward, list[np.ndarray]]


def table_chunks(shard: Shard, state: table_state.State, chunk_bytes: int, base: pb.ReplicaForward) -> list[Chunk]:
    """Under the shard's lock, from its table's snapshot `state` (copies, keys ascending): a catch-up's chunks
    (base: an install with ref, epoch, version, spec and pull_index); chunk 0 holds the admission filter,
    counters and push record, then the rest of the filter if it does not fit (table_state.filter_pieces: no chunk
    over chunk_bytes), each later one keys with their rows, slots and metadata, about chunk_bytes (one key at
    least); chunk_start numbers them, chunk_more marks all but the last."""
    per_key = {name: arr for name, arr in state.items() if table_state.per_key(name)}
    parts = table_state.filter_pieces({name: arr for name, arr in state.items() if name not in per_key}, chunk_bytes)
    n = int(per_key["keys"].shape[0])
    row_bytes = max(1, sum(arr.nbytes for arr in per_key.values()) // max(1, n))
    step = max(1, chunk_bytes // row_bytes)
    parts += [{name: arr[i:i + step] for name, arr in per_key.items()} for i in range(0, n, step)]
    out: list[Chunk] = []
    for i, part in enumerate(parts):
        msg = pb.ReplicaForward()
        msg.CopyFrom(base)
        msg.chunk_start, msg.chunk_more = i, i < len(parts) - 1
        arrays = [np.array(shard.value, copy=True)]  # empty: a table has no whole value
        msg.value.CopyFrom(codec.header(arrays[0].dtype, arrays[0].shape))
        for name in sorted(part):  # views of the snapshot's copies
            msg.slots[TABLE + name].CopyFrom(codec.header(part[name].dtype, part[name].shape))
            arrays.append(part[name])
        if i == 0:
            msg.record = json.dumps(shard.record.state())
        out.append((msg, arrays))
    return out


def state_bytes(state: table_state.State) -> int:
    """A table state's size."""
    return sum(arr.nbytes for arr in state.values())


@dataclass
class Staged:
    """A backup's copy of a shard being caught up in chunks: full-size arrays, the first `rows` rows filled and
    brought to `shard.version`; not in the store until its last chunk. A table's: `rows` chunks taken, its
    table built so far, `rest` the filter and counters of chunk 0 (loaded with the last chunk)."""

    shard: Shard
    rows: int
    epoch: int
    rest: table_state.State | None = None


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

    def keys(self) -> list[Key]:
        """The shards with a catch-up under way."""
        return list(self._staged)

    def drop_before(self, key: Key, epoch: int | None) -> None:
        """Forget key's catch-up under way if it is of an epoch before `epoch` (None: this PS no longer backs
        key up): the roles changed, so its primary starts any catch-up again from its first chunk, and a
        half-built copy must not hold a shard's memory until then (an aborted move: never)."""
        staged = self._staged.get(key)
        if staged is not None and (epoch is None or staged.epoch < epoch):
            del self._staged[key]

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
        self._staged.pop(key, None)
        if staged.shard.table is not None and staged.rest is not None:
            table_state.load_rest(staged.shard.table, staged.rest)  # the table is complete: its filter and counters
        return "applied", staged.shard, True


def begin(f: pb.ReplicaForward, tensors: list[np.ndarray], dedup_window: int) -> Staged:
    """Stage the first chunk of an install: the arrays at the shard's full shape, its first rows filled."""
    spec = spec_from_pb(f.spec)
    if spec.table:
        return _begin_table(f, tensors, dedup_window)
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
    if staged.shard.table is not None:
        if staged.rest is not None and not any(table_state.per_key(n[len(TABLE):]) for n in f.slots if n.startswith(TABLE)):
            table_state.add_piece(staged.rest, _table_part(f, tensors, False))  # more of the filter (filter_pieces)
        else:
            table_state.load_rows(staged.shard.table, _table_part(f, tensors, True))
        staged.rows += 1
    else:
        _fill(staged, tensors)
    return "applied"


def _begin_table(f: pb.ReplicaForward, tensors: list[np.ndarray], dedup_window: int) -> Staged:
    """Stage a table's chunk 0: an empty table of the spec, the filter and counters kept for the last chunk."""
    spec = spec_from_pb(f.spec)
    table = DynamicTable(TableConfig.from_json(spec.table), spec.optimizer, shard_name(spec))
    record = PushRecord.from_state(json.loads(f.record) if f.record else {}, dedup_window, f.version)
    rest = {name: np.array(t, copy=True) for name, t in _table_part(f, tensors, False).items()}
    if "meta" not in rest:
        raise InvalidArgumentError(f"{table.name}: a table catch-up's first chunk lacks its meta")
    return Staged(Shard(spec, np.array(tensors[0], copy=True), {}, f.version, record=record, table=table), 1, f.epoch,
                  rest)


def _table_part(f: pb.ReplicaForward, tensors: list[np.ndarray], keyed: bool) -> table_state.State:
    """A table chunk's arrays by state name: per-key ones (keyed), else the filter's and meta."""
    part: table_state.State = {}
    for name, t in zip(sorted(f.slots), tensors[1:]):
        if not name.startswith(TABLE) or table_state.per_key(name[len(TABLE):]) != keyed:
            raise InvalidArgumentError(f"{f.ref.variable}[{f.ref.shard_index}]: a table catch-up chunk "
                                       f"{f.chunk_start} carries {name!r}, not its part of the state")
        part[name[len(TABLE):]] = t
    if keyed and "keys" not in part:
        raise InvalidArgumentError(f"{f.ref.variable}[{f.ref.shard_index}]: a table catch-up chunk "
                                   f"{f.chunk_start} carries no keys")
    return part


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
