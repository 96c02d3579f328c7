"""`History`: the per-epoch logs of a `fit` run (Keras's `model.fit(...)` return value)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pscluster.training.callbacks import Callback


class History(Callback):
    """Records every epoch's logs: `history.history["loss"][e]`, `history.epoch == [0, 1, ...]`."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        """Append the epoch's logs."""
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(float(value))

    def get_state(self) -> dict[str, Any]:
        """The epochs recorded so far (restored by BackupAndRestore)."""
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in self.history.items()}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state."""
        self.epoch = [int(e) for e in state["epoch"]]
        self.history = {str(k): [float(x) for x in v] for k, v in state["history"].items()}
