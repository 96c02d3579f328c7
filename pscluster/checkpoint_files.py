"""The layout of a checkpoint directory, shared by the PS tasks that write it and the programs that read it.

    <checkpoint_dir>/step-<N>/ps-<i>-of-<P>.safetensors     one file per PS task, written atomically

A step is complete when all P files of one task count P are there; with replicas: 2 a down task's file may
be an empty one (header `absent`) that a live task wrote once every shard had a live copy saved. A save
taken while the PS list changed may mix counts: then it is not complete, and `missing` says which files it
lacks. Each file holds its task's shards as
`<variable>/<shard>/value` (and `/slot/<name>`) tensors, and a `shards` JSON header with every shard's
spec (full shape, row offset) and version. `read_variables` assembles whole variables from a step's
files, which is what an evaluator needs (the safetensors files hold no pickles).
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np

STEP_DIR = re.compile(r"step-(\d+)$")
TASK_FILE = re.compile(r"ps-(\d+)-of-(\d+)\.safetensors$")


def _by_count(step_dir: pathlib.Path) -> dict[int, dict[int, pathlib.Path]]:
    """The task files of one step's directory by the task count P they name, then by task index."""
    groups: dict[int, dict[int, pathlib.Path]] = {}
    for f in step_dir.iterdir():
        fm = TASK_FILE.match(f.name)
        if fm:
            groups.setdefault(int(fm.group(2)), {})[int(fm.group(1))] = f
    return groups


def task_files(step_dir: pathlib.Path) -> tuple[dict[int, pathlib.Path], int | None]:
    """The task files present in one step's directory by task index, and the task count they name.

    A save taken while the PS list changed (docs/elastic.md) may hold files of two counts: the complete
    count if there is one, else the one with the most files (the larger on a tie), so the answer does not
    depend on the directory's order."""
    groups = _by_count(step_dir)
    if not groups:
        return {}, None
    total = max(groups, key=lambda p: (set(groups[p]) == set(range(p)), len(groups[p]), p))
    return groups[total], total


def missing(step_dir: pathlib.Path) -> str:
    """Why one step is not complete ('' if it is): the task files it lacks, and the counts it mixes."""
    groups = _by_count(step_dir)
    files, total = task_files(step_dir)
    if total is None:
        return "no task files"
    if set(files) == set(range(total)):
        return ""
    lacks = ", ".join(f"ps-{i}-of-{total}" for i in range(total) if i not in files)
    if len(groups) == 1:
        return f"{lacks} missing (a save that did not finish)"
    counts = " and ".join(str(p) for p in sorted(groups))
    return (f"{lacks} missing; it holds files of P = {counts}: the PS list changed while it was saved "
            "(a PS joined or left), so it is not restored")


def complete_steps(root: pathlib.Path) -> list[tuple[int, list[pathlib.Path]]]:
    """(step, files) of every complete step (all P files of one task count P), oldest first."""
    out: list[tuple[int, list[pathlib.Path]]] = []
    if not root.is_dir():
        return out
    for step_dir in root.iterdir():
        m = STEP_DIR.match(step_dir.name)
        if not m or not step_dir.is_dir():
            continue
        files, total = task_files(step_dir)
        if total and set(files) == set(range(total)):
            out.append((int(m.group(1)), [files[i] for i in range(total)]))
    return sorted(out)


def newer_incomplete(root: pathlib.Path, than: int) -> list[tuple[int, str]]:
    """(step, why) of every step newer than `than` that is not complete, oldest first."""
    out: list[tuple[int, str]] = []
    if not root.is_dir():
        return out
    for step_dir in root.iterdir():
        m = STEP_DIR.match(step_dir.name)
        if m and step_dir.is_dir() and int(m.group(1)) > than and (why := missing(step_dir)):
            out.append((int(m.group(1)), why))
    return sorted(out)


def read_variables(files: list[pathlib.Path]) -> dict[str, np.ndarray]:
    """Whole variables (values only, no optimizer slots) from one complete step's files."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as fh:
            for entry in json.loads(fh.metadata()["shards"]):
                spec = entry["spec"]
                name, shard = spec["variable"], spec["shard_index"]
                if spec.get("table"):
                    continue  # a dynamic table has no whole value (its rows: server/table_state.py)
                value = fh.get_tensor(f"{name}/{shard}/value")
                if spec["num_shards"] == 1 and tuple(spec["shape"]) == tuple(spec["full_shape"]):
                    out[name] = value
                    continue
                whole = out.get(name)
                if whole is None:
                    whole = out[name] = np.zeros(tuple(spec["full_shape"]), value.dtype)
                whole[spec["row_offset"]:spec["row_offset"] + value.shape[0]] = value
    return out
