"""Checkpoints: one safetensors file per PS task per global step, written atomically.

Layout: `<dir>/step-<step>/ps-<i>-of-<P>.safetensors`. A file appears only by rename after fsync, so
its presence means it is complete; a step is complete when all P files are present. Restore reads the
newest complete step and takes the shards whose ordinal maps to this task under the *current* P, so
a checkpoint restores into a different number of PS tasks (re-sharding by placement).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from pscluster.placement import PLACEMENT_VERSION, ps_for_ordinal
from pscluster.server import optimizers as opt
from pscluster.server.store import Shard, ShardSpec, VariableStore

_FILE = re.compile(r"ps-(\d+)-of-(\d+)\.safetensors$")
_STEP = re.compile(r"step-(\d+)$")


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


def _writable(arr: np.ndarray) -> np.ndarray:
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, copy=True, order="C")


def save(store: VariableStore, root: pathlib.Path, step: int, ps_index: int, num_ps: int,
         keep: int, extra: dict[str, object] | None = None) -> pathlib.Path:
    """Write this task's shards at `step` atomically, then prune to the newest `keep` steps."""
    step_dir = root / f"step-{step:012d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    final = step_dir / f"ps-{ps_index}-of-{num_ps}.safetensors"
    tmp = step_dir / f".{final.name}.tmp-{os.getpid()}"
    with store.frozen() as shards:
        tensors: dict[str, np.ndarray] = {}
        meta = []
        for shard in shards:
            base = f"{shard.spec.variable}/{shard.spec.shard_index}"
            tensors[f"{base}/value"] = shard.value
            for name, slot in shard.slots.items():
                tensors[f"{base}/slot/{name}"] = slot
            spec = asdict(shard.spec)
            meta.append({"spec": spec, "version": shard.version, "applied": list(shard.applied)})
        header = {"placement_version": str(PLACEMENT_VERSION), "step": str(step),
                  "shards": json.dumps(meta), "extra": json.dumps(extra or {})}
        save_file(tensors, str(tmp), metadata=header)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(step_dir)
    prune(root, keep, ps_index)
    return final


def complete_steps(root: pathlib.Path) -> list[tuple[int, list[pathlib.Path]]]:
    """(step, files) of every complete step, oldest first."""
    out = []
    if not root.is_dir():
        return out
    for step_dir in root.iterdir():
        m = _STEP.match(step_dir.name)
        if not m or not step_dir.is_dir():
            continue
        files = {}
        total = None
        for f in step_dir.iterdir():
            fm = _FILE.match(f.name)
            if fm:
                files[int(fm.group(1))] = f
                total = int(fm.group(2))
        if total and set(files) == set(range(total)):
            out.append((int(m.group(1)), [files[i] for i in range(total)]))
    return sorted(out)


def prune(root: pathlib.Path, keep: int, ps_index: int) -> None:
    """Remove this task's files of all but the newest `keep` complete steps."""
    steps = complete_steps(root)
    for step, files in steps[:-keep] if len(steps) > keep else []:
        for f in files:
            m = _FILE.match(f.name)
            if m and int(m.group(1)) == ps_index:
                f.unlink(missing_ok=True)
        step_dir = root / f"step-{step:012d}"
        if step_dir.is_dir() and not any(p for p in step_dir.iterdir() if _FILE.match(p.name)):
            shutil.rmtree(step_dir, ignore_errors=True)


def restore(store: VariableStore, root: pathlib.Path, ps_index: int, num_ps: int) -> Restored | None:
    """Load the newest complete step's shards that belong to this task; None if there is none."""
    steps = complete_steps(root)
    if not steps:
        return None
    step, files = steps[-1]
    loaded = 0
    extra: dict[str, object] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as fh:
            header = fh.metadata()
            if path.name.startswith("ps-0-of-"):
                extra = json.loads(header.get("extra", "{}"))
            for entry in json.loads(header["shards"]):
                raw = entry["spec"]
                spec = ShardSpec(**{**raw, "full_shape": tuple(raw["full_shape"]), "shape": tuple(raw["shape"]),
                                    "optimizer": opt.OptimizerConfig(**raw["optimizer"])})
                if ps_for_ordinal(spec.ordinal, num_ps) != ps_index:
                    continue
                base = f"{spec.variable}/{spec.shard_index}"
                value = _writable(fh.get_tensor(f"{base}/value"))
                slots = {name: _writable(fh.get_tensor(f"{base}/slot/{name}")) for name in spec.optimizer.slot_names()}
                applied = OrderedDict((pid, None) for pid in entry["applied"])
                store.install(Shard(spec, value, slots, entry["version"], entry["version"], applied))
                loaded += 1
    return Restored(step, loaded, extra)
