"""BackupAndRestore: the callbacks' own state at each epoch's end, so that a rerun resumes where the PS is.

The model's state needs nothing from this callback: the PS tasks checkpoint it automatically (every N
steps or T seconds, with the learning rate they apply) and restore it when they start with `restore`.
What the PS tasks do not hold is the driver's: the epoch the restored step falls in, History, and each
callback's counters (EarlyStopping's wait, ReduceLROnPlateau's best, CSVLogger's rows, ...). `fit` saves
them here, as JSON, after every epoch's callbacks ran and before the next epoch's first closure is
scheduled, so any PS checkpoint taken in epoch e finds the state saved at the end of epoch e - 1.
A rerun reads the global step the PS tasks restored, turns it into the closures it holds
(fit.completed_closures: R per step in sync mode), resumes at (closures // steps_per_epoch,
closures % steps_per_epoch) and puts back the state saved when that epoch began.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.training.callbacks import Callback


class BackupAndRestore(Callback):
    """Keras's BackupAndRestore on pscluster: keeps the callbacks' state per epoch in backup_dir (newest `keep`)."""

    def __init__(self, backup_dir: str | os.PathLike[str], keep: int = 5) -> None:
        super().__init__()
        if keep < 1:
            raise InvalidArgumentError(f"BackupAndRestore: keep={keep}; keep at least 1 epoch's state")
        self.backup_dir, self.keep = pathlib.Path(backup_dir), keep

    def _path(self, epoch: int) -> pathlib.Path:
        return self.backup_dir / f"epoch-{epoch:06d}.json"

    def saved_epochs(self) -> list[int]:
        """Epochs whose starting state is saved, oldest first."""
        if not self.backup_dir.is_dir():
            return []
        return sorted(int(p.stem.split("-")[1]) for p in self.backup_dir.glob("epoch-*.json"))

    def save(self, epoch: int, learning_rate: float, callbacks: Sequence[Callback]) -> None:
        """Write the state every callback has when `epoch` begins (atomically), and drop the oldest."""
        self.backup_dir.mkdir(parents=True, exist_ok=True)
        state = {"epoch": epoch, "learning_rate": learning_rate,
                 "callbacks": [[type(cb).__name__, cb.get_state()] for cb in callbacks]}
        path = self._path(epoch)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
        for old in self.saved_epochs()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)

    def restore(self, epoch: int, callbacks: Sequence[Callback]) -> float | None:
        """Put back the callbacks' state saved when `epoch` began; returns the learning rate then (None at epoch 0
        with nothing saved: a fresh start).

        Raises:
            FailedPreconditionError: no state saved for that epoch (the PS checkpoint is older than the
                `keep` newest epochs), or the callbacks are not those of the run that saved it.
        """
        path = self._path(epoch)
        if not path.exists():
            if epoch == 0:
                return None
            raise FailedPreconditionError(
                f"BackupAndRestore: the PS tasks restored a step in epoch {epoch}, but {self.backup_dir} holds the "
                f"state of epochs {self.saved_epochs() or 'none'}; rerun with the backup_dir of the run that "
                "wrote those checkpoints (or raise keep=)")
        state: dict[str, Any] = json.loads(path.read_text())
        names = [name for name, _ in state["callbacks"]]
        if names != [type(cb).__name__ for cb in callbacks]:
            raise FailedPreconditionError(f"BackupAndRestore: the run being resumed had callbacks {names}; this one "
                                          f"has {[type(cb).__name__ for cb in callbacks]}: pass the same callbacks")
        for cb, (_, cb_state) in zip(callbacks, state["callbacks"]):
            cb.set_state(cb_state)
        return float(state["learning_rate"])
