"""Checkpoints: one safetensors file per PS task per global step, written atomically.

Layout: `<dir>/step-<step>/ps-<i>-of-<P>.safetensors`. A file appears only by rename after fsync, so
its presence means it is complete; a step is complete when all P files are present. Restore reads the
newest complete step and takes the shards whose ordinal maps to this task under the *current* P, so
a checkpoint restores into a different number of PS tasks (re-sharding by placement).

With replicas: 2 a task that is down while each of its shards has a live copy saved by another task
gets an empty file (header `absent`, written by a live task: save_absent), which completes the step.

Disk stays bounded by `keep` x model size (plus one save in progress): pruning works on whole steps
across tasks (any task removes every step directory older than the newest `keep` complete steps, since a
step is useless once newer complete ones exist, and every incomplete one but the newest), and a temporary
`.ps-i-of-P.safetensors.tmp-PID` left by a save killed mid-write is removed by task i itself, at
start and after each of its saves, when none of its own saves is in flight. Its PID is not asked:
an earlier version kept the temporaries whose PID was a live pscluster process, and on a PID reuse,
another host, or another container's PID namespace (a shared checkpoint volume) that kept them forever.

A dynamic table with `increments` writes increments between full states (server/table_state.py's
for_checkpoint): its entry names the earlier steps they build on (`table_chain`), the file header their
union (`needs`); restore applies them in order, from the files of the same task index *and* writing
process (the header's `writer`: a chain lives in one process), and pruning spares the steps a kept step needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pscluster.server import table_state
from pscluster.server.dynamic_table import DynamicTable
from pscluster.server.push_record import PushRecord
from pscluster.server.store import Key, Shard, ShardSpec, VariableStore, shard_name
from pscluster.server.tensor_files import TensorFile, write

from pscluster.checkpoint_files import STEP_DIR as _STEP
from pscluster.checkpoint_files import TASK_FILE
from pscluster.checkpoint_files import complete_steps as complete_steps
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.optimizer_config import config_from_dict
from pscluster.placement import PLACEMENT_VERSION, ps_for_ordinal
from pscluster.tables import TableConfig

_PROCESS = int.from_bytes(os.urandom(6), "little")  # a save's default writer: a table's chain lives in one process
_TMP = re.compile(r"\.ps-(\d+)-of-(\d+)\.safetensors\.tmp-\d+$")  # task, tasks; the writer's PID


@dataclass(frozen=True)
class Restored:
    """What a restore loaded."""

    step: int
    shards: int
    extra: dict[str, object]


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(store: VariableStore, root: pathlib.Path, step: int, ps_index: int, num_ps: int,
         keep: int, extra: dict[str, object] | None = None,
         holds: Callable[[Key], bool] | None = None,
         epochs: Callable[[Key], int] | None = None, writer: int | None = None) -> pathlib.Path:
    """Write this task's shards at `step` atomically, then prune to the newest `keep` steps; `holds`: the
    shards to write (None: all; replicas: 2 leaves out copies the replica table gives this task no role for);
    `epochs`: each copy's replica epoch, saved with it (None: 0), which ranks it before its version on restore;
    `writer`: the saving process's id (None: this process's), the lineage its table increments build on."""
    step_dir = root / f"step-{step:012d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    final = step_dir / f"ps-{ps_index}-of-{num_ps}.safetensors"
    tmp = step_dir / f".{final.name}.tmp-{os.getpid()}"
    tables: list[DynamicTable] = []
    try:
        with store.frozen() as shards:
            tensors: dict[str, np.ndarray] = {}
            meta = []
            needs: set[int] = set()
            for shard in shards:
                if holds is not None and not holds(shard.spec.key):
                    continue
                base = f"{shard.spec.variable}/{shard.spec.shard_index}"
                tensors[f"{base}/value"] = shard.value
                for name, slot in shard.slots.items():
                    tensors[f"{base}/slot/{name}"] = slot
                spec = {**asdict(shard.spec), "optimizer": shard.spec.optimizer.to_dict()}
                entry: dict[str, object] = {"spec": spec, "version": shard.version, "applied": shard.record.state(),
                                            "epoch": epochs(shard.spec.key) if epochs is not None else 0}
                if shard.table is not None:  # live keys only (or the rows changed since the last save), slots,
                    tables.append(shard.table)  # metadata and admission state
                    state, chain = table_state.for_checkpoint(shard.table, step)
                    for name, arr in state.items():
                        tensors[f"{base}/table/{name}"] = arr
                    if chain:
                        entry["table_chain"] = chain
                    needs.update(chain)
                meta.append(entry)
            header = {"placement_version": str(PLACEMENT_VERSION), "step": str(step), "shards": json.dumps(meta),
                      "extra": json.dumps(extra or {}), "writer": f"{_PROCESS if writer is None else writer:012x}"}
            if needs:
                header["needs"] = json.dumps(sorted(needs))
            write(tmp, tensors, header)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(step_dir)
    except BaseException:
        for table in tables:  # the increments were marked as saved: the next save of each table is full
            with contextlib.suppress(Exception):
                table_state.drop_chain(table)
        raise
    prune(root, keep, ps_index, num_ps)
    return final


def remove_stale_temporaries(root: pathlib.Path, ps_index: int, num_ps: int) -> int:
    """Delete the temporaries no save is writing any more; returns how many.

    Call it only while this task has no save in flight (at start, and from `save` after its rename):
    then every temporary of this task (`.ps-<ps_index>-of-<num_ps>...tmp-*`) was left by an earlier
    incarnation killed mid-write, whatever its PID (a PID says nothing about another host or PID
    namespace, and PIDs are reused). Temporaries of another cluster shape (`-of-<Q>`, Q != num_ps) are
    stale too. Another task's temporaries of this shape may be in flight: that task removes its own.
    """
    removed = 0
    if not root.is_dir():
        return removed
    for step_dir in root.iterdir():
        if not _STEP.match(step_dir.name) or not step_dir.is_dir():
            continue
        here = 0
        for f in step_dir.iterdir():
            m = _TMP.match(f.name)
            if not m or (int(m.group(2)) == num_ps and int(m.group(1)) != ps_index):
                continue
            f.unlink(missing_ok=True)
            here += 1
        if here:
            removed += here
            try:
                step_dir.rmdir()  # only if that temporary was all it held
            except OSError:
                pass
    return removed


def save_absent(root: pathlib.Path, step: int, tasks: list[int], num_ps: int, keep: int, ps_index: int,
                extra: dict[str, object] | None = None) -> list[pathlib.Path]:
    """Write an empty task file at `step` for each task in `tasks` (down while every shard it held has a live
    copy that other tasks saved in this step: the caller checked), which completes the step; a task file
    already there is left alone. The header says `absent`; `extra` is the writer's (restore reads it from
    the first file that is not absent). Returns the files written."""
    step_dir = root / f"step-{step:012d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for task in tasks:
        final = step_dir / f"ps-{task}-of-{num_ps}.safetensors"
        if final.exists():
            continue
        tmp = step_dir / f".{final.name}.tmp-{os.getpid()}"  # task `task` removes it if this save dies mid-write
        write(tmp, {}, {"placement_version": str(PLACEMENT_VERSION), "step": str(step), "shards": "[]",
                        "extra": json.dumps(extra or {}), "writer": f"{_PROCESS:012x}", "absent": "true"})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        out.append(final)
    _fsync_dir(step_dir)
    prune(root, keep, ps_index, num_ps)
    return out


def prune(root: pathlib.Path, keep: int, ps_index: int, num_ps: int) -> None:
    """Keep the newest `keep` complete steps and one save in progress: remove every older step directory
    (any task's files), every incomplete step directory but the newest of all (a save that failed, or one a
    task killed mid-save never finished, is never completed: the next save is at a newer step), and this
    task's stale temporaries (see remove_stale_temporaries). A step a kept step's table increments build on
    stays, complete or not."""
    steps = complete_steps(root)
    kept = steps[-keep:] if steps else []
    oldest_kept = kept[0][0] if len(steps) > keep else -1
    complete = {step for step, _ in steps}
    dirs = {int(m.group(1)): d for d in root.iterdir() if (m := _STEP.match(d.name)) and d.is_dir()}
    newest = max(dirs, default=-1)
    kept_files = [path for _, files in kept for path in files]
    if newest >= 0 and newest not in complete:  # the save in progress: its increments' bases stay too
        with contextlib.suppress(FileNotFoundError):  # another task's prune removed it meanwhile
            kept_files += [f for f in dirs[newest].iterdir() if TASK_FILE.match(f.name)]
    needed = {step for path in kept_files for step in _needs(path)}  # increments' bases
    for step, step_dir in dirs.items():
        if step in needed or step == newest and step not in complete:
            continue
        if step < oldest_kept or step not in complete:
            shutil.rmtree(step_dir, ignore_errors=True)
    remove_stale_temporaries(root, ps_index, num_ps)


def _header(path: pathlib.Path) -> dict[str, str]:
    with TensorFile(path) as fh:
        return dict(fh.metadata())


def _needs(path: pathlib.Path) -> list[int]:
    """The earlier steps a task file's table increments build on (its header's `needs`)."""
    try:
        with TensorFile(path) as fh:
            return [int(x) for x in json.loads(fh.metadata().get("needs", "[]"))]
    except (OSError, ValueError, InvalidArgumentError):
        return []  # a file removed meanwhile (another task's prune) or unreadable: it protects nothing


def _table_part(files: list[pathlib.Path], base: str) -> tuple[table_state.State, list[int]]:
    """A table shard's saved state in one step's files (`base` = variable/shard) and its chain."""
    prefix = f"{base}/table/"
    for path in files:
        with TensorFile(path) as fh:
            for entry in json.loads(fh.metadata()["shards"]):
                if f"{entry['spec']['variable']}/{entry['spec']['shard_index']}" == base:
                    # mapped, not read: table_state.load gathers the rows from the page cache into the table
                    state = {k[len(prefix):]: fh.view(k) for k in fh.keys() if k.startswith(prefix)}
                    return state, [int(x) for x in entry.get("table_chain", [])]
    raise FailedPreconditionError(f"checkpoint step files {[str(p) for p in files]} lack {base}, which a later "
                                  "increment builds on; restore an older complete step or a full one")


def _writer_files(root: pathlib.Path, step: int, writer: int, process: str | None) -> list[pathlib.Path]:
    """Task `writer`'s files in one step's directory (any task count P; complete step or not) that the
    process `process` wrote (None: a file from before headers named it: any).

    An increment builds on its own writer's earlier saves: with replicas: 2 a primary and its backup both
    save a table shard, each with its own chain, and a copy that came to a task by an elastic move starts a
    chain of its own there; another task's file of the same step holds another lineage. So may the same
    task index's file of another process (an earlier cluster of another P left an incomplete step that this
    one saved again): a chain never outlives its process, so the writer's process id picks the file."""
    step_dir = root / f"step-{step:012d}"
    if not step_dir.is_dir():
        return []
    files = sorted(f for f in step_dir.iterdir() if (m := TASK_FILE.match(f.name)) and int(m.group(1)) == writer)
    return files if process is None else [f for f in files if _process_of(f) == process]


def _process_of(path: pathlib.Path) -> str | None:
    """The id of the process that wrote a task file (None: unreadable, or written before headers named it)."""
    try:
        with TensorFile(path) as fh:
            return fh.metadata().get("writer")
    except (OSError, ValueError, InvalidArgumentError):
        return None


def _table_state(root: pathlib.Path, own: table_state.State, chain: list[int], base: str,
                 writer: int, process: str | None) -> table_state.State:
    """A table shard's whole state: the full state of chain[0] with every later increment applied in order
    (task `writer` saved all of them)."""
    if not chain:
        return own
    # a base need not be a complete step: this task's own save of it may have landed while another task's
    # failed (the chain grows with every local save); its file is all an increment builds on
    steps = {s: files for s in chain if (files := _writer_files(root, s, writer, process))}
    missing = [s for s in chain if s not in steps]
    if missing:
        raise FailedPreconditionError(f"{base}: the increments saved at {chain} need steps {missing}, which are gone "
                                      f"from {root}")
    state, first_chain = _table_part(steps[chain[0]], base)
    if first_chain:
        raise FailedPreconditionError(f"{base}: step {chain[0]} holds an increment where a full state was expected")
    for step in chain[1:]:
        state = table_state.apply_delta(state, _table_part(steps[step], base)[0])
    return table_state.apply_delta(state, own)


def restore(store: VariableStore, root: pathlib.Path, ps_index: int, num_ps: int,
            held: bool = False) -> Restored | None:
    """Load the newest complete step's shards that belong to this task; None if there is none.

    A shard belongs here when its ordinal maps to this task under `num_ps` (placement: what a whole
    cluster restarting from the files needs), and with `held` (replicas: 2) also when this task's own file
    of the step lists it: the task held the shard then, as primary or backup, wherever elastic moves and
    failovers had put it, and the replica table may name it to bring the shard back (both copies died).
    A shard saved by several tasks (a primary and its backup, each at its own instant) comes from its copy
    of the newest replica epoch, then the highest version, the newest state saved (ties: a full table state
    before an increment, then the lowest task index), so every restoring task takes the same copy. Versions
    order a shard's copies only within one epoch: a deposed primary that still believed it led may have
    saved an unacknowledged update at the version its promoted backup gave an acknowledged one. A file
    written before entries carried an epoch counts its copies as epoch 0.
    """
    steps = complete_steps(root)
    if not steps:
        return None
    step, files = steps[-1]
    extra: dict[str, object] = json.loads(_header(files[0]).get("extra", "{}"))  # every file absent: the writer's
    extra_found = False
    best: dict[str, tuple[tuple[int, int, int, int], int, dict[str, Any]]] = {}  # base -> (rank, index, entry)
    own: set[str] = set()
    processes: dict[int, str | None] = {}  # file index -> the process that wrote it (its tables' lineage)
    for index, path in enumerate(files):
        with TensorFile(path) as fh:
            header = fh.metadata()
        processes[index] = header.get("writer")
        if not extra_found and header.get("absent") != "true":  # an absent task's file has another's extra
            extra, extra_found = json.loads(header.get("extra", "{}")), True
        for entry in json.loads(header["shards"]):
            base = f"{entry['spec']['variable']}/{entry['spec']['shard_index']}"
            rank = (int(entry.get("epoch", 0)), int(entry["version"]), -len(entry.get("table_chain", [])), -index)
            if base not in best or rank > best[base][0]:
                best[base] = (rank, index, entry)
            if held and index == ps_index:
                own.add(base)
    chosen: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for base, (_, index, entry) in best.items():
        if base in own or ps_for_ordinal(int(entry["spec"]["ordinal"]), num_ps) == ps_index:
            chosen.setdefault(index, []).append((base, entry))
    loaded = 0
    for index, entries in sorted(chosen.items()):
        with TensorFile(files[index]) as fh:
            for base, entry in entries:
                raw = entry["spec"]
                spec = ShardSpec(**{**raw, "full_shape": tuple(raw["full_shape"]), "shape": tuple(raw["shape"]),
                                    "optimizer": config_from_dict(raw["optimizer"])})
                value = fh.get(f"{base}/value")
                slots = {name: fh.get(f"{base}/slot/{name}")
                         for name in ([] if spec.table else spec.optimizer.slot_names())}
                record = PushRecord.from_state(entry["applied"], store.dedup_window, version=entry["version"])
                table = None
                if spec.table:
                    table = DynamicTable(TableConfig.from_json(spec.table), spec.optimizer, shard_name(spec))
                    prefix = f"{base}/table/"
                    # mapped, not read: table_state.load gathers the rows from the page cache into the table
                    state = {k[len(prefix):]: fh.view(k) for k in fh.keys() if k.startswith(prefix)}
                    chain = entry.get("table_chain", [])
                    table_state.load(table, _table_state(root, state, chain, base, index, processes[index]))
                store.install(Shard(spec, value, slots, entry["version"], entry["version"], record, table=table))
                loaded += 1
    return Restored(step, loaded, extra)
