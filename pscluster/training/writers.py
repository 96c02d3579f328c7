"""Callbacks that write files: ModelCheckpoint (safetensors), CSVLogger and TensorBoard (event files)."""

from __future__ import annotations

import csv
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from pscluster.errors import InvalidArgumentError
from pscluster.training.callbacks import Callback, Logs, monitor_mode, monitored


class ModelCheckpoint(Callback):
    """Keras's ModelCheckpoint: every variable to a safetensors file per epoch, or only when `monitor` improves.

    `filepath` is formatted with the epoch (counting from 1, as Keras) and the epoch's logs:
    `"ckpt/weights_{epoch:02d}_{val_loss:.3f}.safetensors"`. Each file is written whole, then renamed.
    """

    def __init__(self, filepath: str | os.PathLike[str], monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, mode: str = "auto", save_freq: str = "epoch",
                 initial_value_threshold: float | None = None) -> None:
        super().__init__()
        self.filepath = str(filepath)
        if not self.filepath.endswith(".safetensors"):
            raise InvalidArgumentError(f"ModelCheckpoint: filepath {self.filepath!r} must end in .safetensors "
                                       "(every variable is written, whole, as one safetensors file)")
        if save_freq != "epoch":
            raise InvalidArgumentError(f"ModelCheckpoint: save_freq={save_freq!r}; only 'epoch' is supported "
                                       "(mid-epoch state is what BackupAndRestore's automatic checkpoints keep)")
        self.monitor, self.verbose, self.save_best_only = monitor, verbose, save_best_only
        self.mode = monitor_mode(monitor, mode)
        self.best: float = initial_value_threshold if initial_value_threshold is not None else \
            (math.inf if self.mode == "min" else -math.inf)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Write the weights (if the monitored value improved, with save_best_only)."""
        logs = dict(logs or {})
        if self.save_best_only:
            current = monitored(self.monitor, logs, "ModelCheckpoint")
            if current is None:
                return
            better = current < self.best if self.mode == "min" else current > self.best
            if not better:
                return
            self.best = current
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except KeyError as exc:
            raise InvalidArgumentError(f"ModelCheckpoint: filepath {self.filepath!r} names {exc}, which is not in "
                                       f"the epoch's logs ({', '.join(sorted(logs))})") from None
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        self.model.save_weights(tmp)
        os.replace(tmp, path)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: saved the model to {path}")

    def get_state(self) -> dict[str, Any]:
        """The best monitored value so far."""
        return {"best": self.best}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved best value."""
        self.best = float(state["best"])


class CSVLogger(Callback):
    """Keras's CSVLogger: one row per epoch (epoch, then the logs' names in sorted order)."""

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename, self.sep, self.append = pathlib.Path(filename), separator, append
        self.rows = 0  # epochs written by this run (and the run it resumes)
        self._resumed = False
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Start a new file unless appending."""
        self.rows, self._resumed, self._keys = 0, False, None

    def _open_rows(self) -> list[list[str]]:
        if not self.filename.exists() or not (self.append or self._resumed):
            return []
        with open(self.filename, newline="") as f:
            rows = list(csv.reader(f, delimiter=self.sep))
        if self._resumed:  # keep the header and the epochs the restored state counts; drop a lost epoch's row
            rows = rows[:1 + self.rows] if rows else []
        return rows

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Append the epoch's row (rewriting the file the first time, to drop rows a resumed run repeats)."""
        logs = dict(logs or {})
        if self._keys is None:
            rows = self._open_rows()
            self._keys = rows[0][1:] if rows else sorted(logs)
            with open(self.filename, "w", newline="") as f:
                csv.writer(f, delimiter=self.sep).writerows(rows or [["epoch", *self._keys]])
        with open(self.filename, "a", newline="") as f:
            csv.writer(f, delimiter=self.sep).writerow([epoch, *(logs.get(k, "NA") for k in self._keys)])
        self.rows += 1

    def get_state(self) -> dict[str, Any]:
        """The number of epoch rows written."""
        return {"rows": self.rows}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resume: keep that many rows of the existing file and append after them."""
        self.rows, self._resumed = int(state["rows"]), True


class TensorBoard(Callback):
    """Keras's TensorBoard: epoch scalars as `epoch_<name>` under log_dir/train and log_dir/validation
    (val_* names), the learning rate included; with update_freq=N, `batch_<name>` every N closures."""

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise InvalidArgumentError(f"TensorBoard: update_freq={update_freq!r}; use 'epoch' or a positive int")
        self.log_dir, self.update_freq = pathlib.Path(log_dir), update_freq
        self._writers: dict[str, Any] = {}
        self._epoch = 0

    def _writer(self, which: str) -> Any:
        if which not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[which] = SummaryWriter(str(self.log_dir / which))
        return self._writers[which]

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Remember the epoch (the batch curves' x axis counts closures over epochs)."""
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Every update_freq closures: the closure's scalars as batch_<name>."""
        if self.update_freq == "epoch" or (batch + 1) % int(self.update_freq):
            return
        step = self._epoch * int(self.params.get("steps") or 0) + batch
        for name, value in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{name}", float(value), step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Write the epoch's scalars and flush."""
        for name, value in (logs or {}).items():
            which, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            self._writer(which).add_scalar(f"epoch_{tag}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Close the event files."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
