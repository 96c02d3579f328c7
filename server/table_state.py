"""A dynamic table's saved state: full and incremental snapshots, re-sharding, export for serving.

A state is a flat dict of arrays (safetensors-ready): live keys, their rows, slots and metadata in
the same order, the admission filter's arrays (prefixed `filter.`), and `meta` = [version, epoch,
inserted, evicted, dropped, refused]. Only live keys are saved. A snapshot is taken under the table's
lock by the caller, so it is one consistent point between pushes. Keys are sorted ascending, except in
the states checkpoints write (`for_checkpoint`): those keep the table's row order, so a table whose row
ids have no holes saves views of its own arrays, written to the file with no copy and no sort (files
written before held sorted keys; every reader takes either order: load re-hashes the keys).

Incremental: `mark()` starts tracking; `delta()` then holds the rows created or updated since the
last mark, the keys removed since then, and the whole (bounded) filter; `apply_delta(base, delta)`
gives exactly the state a full snapshot would have given. Re-sharding (`reshard`) merges the states
of every old shard and splits them by the stable key hash, so N shards restore into any M.

    state = snapshot(table); mark(table); ...; d = delta(table)
    restored = [load(DynamicTable(cfg, optimizer), s) for s in reshard([apply_delta(state, d)], 3)]
"""

from __future__ import annotations

import pathlib

import numpy as np
from pscluster.server import table_kernels as kernels
from pscluster.server.dynamic_table import REMOVED_LOG_LIMIT as REMOVED_LOG_LIMIT
from pscluster.server.dynamic_table import DynamicTable, TableStats
from pscluster.server.rows import argsort_unique, as_run, take_rows

from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.tables import write_export

State = dict[str, np.ndarray]
_ROW_FIELDS = ("values", "last_step", "freq", "touched_s")
_FILTER = "filter."
_PER_KEY_FILTER = ("pending_keys", "pending_count", "pending_seen")


def _row_arrays(table: DynamicTable) -> dict[str, np.ndarray]:
    arrays = {"values": table.values, "last_step": table.last_step}
    if table.freq.size:
        arrays["freq"] = table.freq
    if table.touched_s.size:
        arrays["touched_s"] = table.touched_s
    arrays.update({f"slot.{name}": slot for name, slot in table.slots.items()})
    return arrays


def _rows_state(table: DynamicTable, rows: np.ndarray | slice, ordered: bool = True) -> State:
    keys = table.index.row_keys[:table.index.high_water]
    at: np.ndarray | slice = rows
    if not isinstance(rows, slice):
        order = rows[argsort_unique(keys[rows])] if ordered else rows  # live keys are distinct
        at = order if ordered else as_run(order)  # unordered, no holes: slices, views of the table's arrays
    state: State = {"keys": keys[at] if isinstance(at, slice) else take_rows(keys, at)}
    for name, arr in _row_arrays(table).items():
        state[name] = arr[at] if isinstance(at, slice) else take_rows(arr, at)
    for name, arr in table.filter.state().items():
        state[_FILTER + name] = arr
    s = table.stats
    state["meta"] = np.array([table.version, table.epoch, s.inserted, s.evicted, s.dropped, s.refused], np.int64)
    return state


def snapshot(table: DynamicTable, ordered: bool = True) -> State:
    """Every live key with its row, slots, metadata and the admission filter (hold table.lock): copies,
    keys sorted; or with ordered=False, in row order and views of the table's arrays where its rows have
    no holes (valid until the table changes: write them before letting go of the lock)."""
    index = table.index
    if not ordered and index.live == index.high_water:  # no holes: rows 0 .. live - 1, no scan of the flags
        return _rows_state(table, slice(0, index.live), ordered)
    return _rows_state(table, index.live_rows(), ordered)


def mark(table: DynamicTable) -> None:
    """Start (or restart) change tracking here: the next delta holds what changes after this point."""
    table.dirty[:table.index.high_water] = False
    table.removed_log = []
    table.removed_logged = 0


def delta(table: DynamicTable) -> State:
    """Rows created or updated and keys removed since the last mark; then marks (hold table.lock).

    Raises:
        FailedPreconditionError: no mark yet, or more than REMOVED_LOG_LIMIT removals since it (the log was dropped).
    """
    log = table.removed_log
    if log is None:  # never marked, or dropped past REMOVED_LOG_LIMIT removals (DynamicTable._remove)
        raise FailedPreconditionError(f"{table.name}: no incremental base to build on; take a full snapshot")
    rows = table.index.live_rows()
    state = _rows_state(table, rows[table.dirty[rows]])
    state["removed"] = np.unique(np.concatenate(log)) if log else np.zeros(0, np.int64)
    mark(table)
    return state


def for_checkpoint(table: DynamicTable, step: int) -> tuple[State, list[int]]:
    """The state a checkpoint at `step` writes (hold table.lock) and the earlier steps it builds on.

    With `increments` = k in the table's config, a full state is followed by up to k increments (rows
    changed and keys removed since the previous save; `chain` lists the steps from the full one to the
    previous save, [] for a full state). A table without a base in this process (just created, restored,
    promoted, or after a failed save: see `drop_chain`) or past REMOVED_LOG_LIMIT removals saves in full.
    """
    k = table.cfg.increments
    # a second save at the same step (a retried Save) must not write an increment over its own base
    if k and table.chain and len(table.chain) <= k and table.removed_log is not None and step > table.chain[-1]:
        try:
            state, chain = delta(table), list(table.chain)
            table.chain.append(step)
            return state, chain
        except FailedPreconditionError:
            pass  # too many removals to list: a full state instead
    state = snapshot(table, ordered=False)  # the caller writes it holding the lock (checkpoint.save)
    if k:
        mark(table)
        table.chain = [step]
    return state, []


def drop_chain(table: DynamicTable) -> None:
    """Forget the incremental base (a save that did not complete): the next checkpoint is full."""
    table.chain = []
    table.removed_log = None


def apply_delta(base: State, change: State) -> State:
    """The state after `change` (a delta) on `base` (a full state or an earlier result)."""
    gone = np.union1d(change["removed"], change["keys"])  # updated rows are replaced whole
    keep = ~np.isin(base["keys"], gone)
    out: State = {}
    keys = np.concatenate([base["keys"][keep], change["keys"]])
    order = argsort_unique(keys)
    out["keys"] = keys[order]
    for name in base:
        if name in ("keys", "removed") or name.startswith(_FILTER) or name == "meta":
            continue
        out[name] = np.concatenate([base[name][keep], change[name]])[order]
    for name in change:
        if name.startswith(_FILTER) or name == "meta":
            out[name] = change[name]
    return out


def reshard(states: list[State], num_shards: int, ordered: bool = True) -> list[State]:
    """Merge every shard's state and split it for num_shards shards by the stable key hash (see split).

    Per-key arrays follow their keys, sorted by key; with ordered=False, in the order they came, which
    is all `load` needs (no sort; a shard that keeps every row gets the arrays themselves).
    """
    out = []
    for part, where in split(states, num_shards):
        if ordered:
            sub = part["keys"][where]
            if sub.size > 1 and not np.logical_and.reduce(sub[:-1] <= sub[1:]):  # one state's keys come sorted
                where = where[argsort_unique(sub)]
        whole = not ordered and where.size == part["keys"].size
        out.append({name: arr if not per_key(name) or whole else take_rows(arr, where) for name, arr in part.items()})
    return out


def split(states: list[State], num_shards: int) -> list[tuple[State, np.ndarray]]:
    """Every shard's part of the merged states, not yet gathered: (part, where) per shard, where the
    part's per-key arrays are the merged ones (shared, not copied) and `where` lists the shard's
    positions in them; its filter and meta are its own. `load(table, part, where)` gathers the rows
    straight into the table's arrays, with no copy of the shard's rows in between.

    Sketches are summed (a count-min sketch over the union of keys: never an under-estimate); counters
    are summed onto shard 0, the version is shared.
    """
    if num_shards < 1 or not states:
        raise InvalidArgumentError(f"reshard needs states and num_shards >= 1, got {len(states)}, {num_shards}")
    versions = {int(s["meta"][0]) for s in states}
    if len(versions) != 1:
        raise InvalidArgumentError(f"shard states of different versions {sorted(versions)}: not one checkpoint")
    merged: State = {}
    for name in states[0]:
        parts = [s[name] for s in states]
        if name == "meta":
            meta = np.sum(parts, axis=0)
            meta[0], meta[1] = parts[0][0], parts[0][1]
            merged[name] = meta
        elif name == _FILTER + "sketch":
            merged[name] = np.minimum(np.sum(parts, axis=0, dtype=np.int64), np.iinfo(np.uint32).max).astype(np.uint32)
        elif name == _FILTER + "pending_forgotten":
            merged[name] = np.array([sum(int(p.sum()) for p in parts)], np.int64)
        else:
            merged[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    out: list[tuple[State, np.ndarray]] = []
    row_shards = kernels.group_by_shard(merged["keys"], num_shards)
    pend_shards = kernels.group_by_shard(merged.get(_FILTER + "pending_keys", np.zeros(0, np.int64)), num_shards)
    for i in range(num_shards):
        rows, pend = row_shards[i], pend_shards[i]
        part: State = {}
        for name, arr in merged.items():
            if name == "meta":
                part[name] = arr if i == 0 else np.array([arr[0], arr[1], 0, 0, 0, 0], np.int64)
            elif name == _FILTER + "pending_forgotten":
                part[name] = arr if i == 0 else np.zeros(1, np.int64)
            elif name.startswith(_FILTER) and name[len(_FILTER):] in _PER_KEY_FILTER:
                part[name] = _sorted_take(merged[_FILTER + "pending_keys"], arr, pend)
            else:
                part[name] = arr
        out.append((part, rows))
    return out


def filter_pieces(state: State, piece_bytes: int) -> list[State]:
    """A state's arrays that are not per key (meta and the admission filter's) cut into pieces of at most
    piece_bytes each (one element at least): the first holds meta, then each filter array goes flat, in
    name order, its slices over as many pieces as it needs. `add_piece` joins them again; the filter's
    load takes the flat arrays (SketchAdmit reshapes its sketch).

    Why: a catch-up's first chunk carried the whole filter, 16 MiB for a default count-min sketch, over
    any chunk size (server/catch_up.py), so a frame limit below that could never carry it.
    """
    meta = state["meta"]
    pieces: list[State] = [{"meta": meta}]
    room = piece_bytes - meta.nbytes
    for name in sorted(n for n in state if n.startswith(_FILTER)):
        flat = np.ascontiguousarray(state[name]).reshape(-1)
        start = 0
        while True:
            take = min(flat.size - start, max(room // flat.itemsize, 0 if pieces[-1] else 1))
            if take <= 0 and start < flat.size:  # no room for one element here: the next piece
                pieces.append({})
                room = piece_bytes
                continue
            pieces[-1][name] = flat[start:start + take]
            room -= take * flat.itemsize
            start += take
            if start >= flat.size:
                break
    return pieces


def add_piece(rest: State, piece: State) -> None:
    """Append a later piece of `filter_pieces` to the pieces joined so far (`rest`, from the first piece).

    Raises:
        InvalidArgumentError: the piece is empty, carries meta or a per-key array, or a dtype other than
            the part before it (nothing changed).
    """
    if not piece:
        raise InvalidArgumentError("a later piece of a table's filter carries nothing")
    for name, arr in piece.items():
        if not name.startswith(_FILTER):
            raise InvalidArgumentError(f"a later piece of a table's filter carries {name!r}")
        if name in rest and (rest[name].dtype != arr.dtype or arr.ndim != 1):
            raise InvalidArgumentError(f"a piece of the table's {name!r} of {arr.dtype} x {arr.shape} does not "
                                       f"continue its {rest[name].dtype} x {rest[name].shape}")
    for name, arr in piece.items():
        rest[name] = np.concatenate([rest[name].reshape(-1), arr]) if name in rest else np.array(arr, copy=True)


def per_key(name: str) -> bool:
    """Whether a state's array of this name has one row per key (not the filter's arrays or meta)."""
    return name != "meta" and not name.startswith(_FILTER)


def _sorted_take(keys: np.ndarray, arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    sub = keys[idx]
    if sub.size > 1 and not np.logical_and.reduce(sub[:-1] <= sub[1:]):  # one state's keys come sorted
        idx = idx[argsort_unique(sub)]
    return take_rows(arr, idx)


def load(table: DynamicTable, state: State, where: np.ndarray | None = None) -> DynamicTable:
    """Fill an empty table from a state (its own shard's part; with `where`, the keys at those positions
    of its per-key arrays, as `split` gives them); returns the table.

    Raises:
        InvalidArgumentError: the table is not empty, or the state does not fit its config.
    """
    if table.live:
        raise InvalidArgumentError(f"{table.name}: restore needs an empty table, this one holds {table.live} keys")
    _insert(table, state, where)
    return load_rest(table, state)


def load_rows(table: DynamicTable, state: State) -> None:
    """Add a part of a state's keys (ascending, none in the table yet) with their rows, slots and metadata to a
    table being built part by part (a catch-up in chunks: server/catch_up.py); `load_rest` ends it.

    Raises:
        InvalidArgumentError: the keys are not ascending, some are in the table already, or the part does not
            fit the table's config (nothing changed).
    """
    keys = state["keys"]
    if keys.ndim != 1 or (keys.size > 1 and not np.logical_and.reduce(keys[:-1] < keys[1:])):
        raise InvalidArgumentError(f"{table.name}: a part of a table's state needs distinct ascending keys")
    if keys.size and bool((table.lookup(keys) >= 0).any()):
        raise InvalidArgumentError(f"{table.name}: a part of a table's state repeats keys the table holds")
    _insert(table, state, None)


def load_rest(table: DynamicTable, state: State) -> DynamicTable:
    """The admission filter, version and counters of a state (its `filter.` arrays and meta); returns the table."""
    table.filter.load({k[len(_FILTER):]: v for k, v in state.items() if k.startswith(_FILTER)})
    meta = [int(x) for x in state["meta"]]
    table.version, table.epoch = meta[0], meta[1]
    table.stats = TableStats(*meta[2:6])
    return table


def _insert(table: DynamicTable, state: State, where: np.ndarray | None) -> None:
    """Give a state's keys rows in the table and copy their per-key arrays there (checked first)."""
    keys = state["keys"] if where is None else take_rows(state["keys"], where)
    if keys.size > table.cfg.capacity - table.live:
        raise InvalidArgumentError(
            f"{table.name}: {keys.size} saved keys exceed the shard's capacity {table.cfg.capacity} "
            f"({table.live} held)")
    if state["values"].shape[1:] != (table.cfg.dim,):
        raise InvalidArgumentError(
            f"{table.name}: saved rows of width {state['values'].shape[1:]} for a table of dim {table.cfg.dim}")
    arrays = _row_arrays(table)
    saved = {name for name in state if name not in ("keys", "meta", "removed") and not name.startswith(_FILTER)}
    if "freq" not in arrays:
        saved.discard("freq")  # saved when every policy kept a frequency: only LFU reads it
    if saved != set(arrays):
        what = ", ".join(repr(n) for n in sorted(set(arrays) - saved)) or "nothing"
        raise InvalidArgumentError(f"{table.name}: saved state lacks {what} and has {sorted(saved - set(arrays))} "
                                   "(saved under another optimizer or eviction policy?)")
    if where is None and any(state[name].shape[:1] != keys.shape for name in arrays):
        raise InvalidArgumentError(f"{table.name}: a state's per-key arrays do not have one row per key")
    rows = as_run(table.index.insert(keys))  # an empty table hands out one run: whole-array copies
    for name, arr in arrays.items():
        if where is None:
            arr[rows] = state[name]
        elif isinstance(rows, slice):  # gathered straight into the table's own rows
            take_rows(state[name], where, out=arr[rows])
        else:
            arr[rows] = take_rows(state[name], where)


def export(state: State, directory: pathlib.Path, name: str,
           float16: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
    """Write NAME.keys (int64, sorted) and NAME.values (rows in that order) as .npy files for serving."""
    keys, values = state["keys"], state["values"]
    if keys.size > 1 and not np.logical_and.reduce(keys[:-1] < keys[1:]):  # a checkpoint's row order
        order = argsort_unique(keys)
        keys, values = keys[order], take_rows(values, order)
    return write_export(keys, values, directory, name, float16)
