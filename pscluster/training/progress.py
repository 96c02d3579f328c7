"""The per-epoch progress bar of `fit` (rich, as the demo's): closures done, running loss, steps/s."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


def format_logs(logs: Mapping[str, float]) -> str:
    """`loss: 0.1234 - accuracy: 0.9700 - val_loss: ...` as Keras prints an epoch's end."""
    return " - ".join(f"{name}: {value:.4g}" for name, value in logs.items())


class EpochBar:
    """One rich bar per epoch; verbose=0 shows nothing, 2 one line per epoch (as Keras)."""

    REFRESH_S = 0.1

    def __init__(self, epoch: int, epochs: int, steps: int, done: int, verbose: int) -> None:
        self.verbose, self.epoch, self.epochs = verbose, epoch, epochs
        self._start = time.perf_counter()
        self._shown = 0.0
        self._bar: Any = None
        if verbose == 1:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = [TextColumn(f"Epoch {epoch + 1}/{epochs}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.0f} steps/s"),
                       TimeElapsedColumn()]
            self._bar = Progress(*columns, transient=False)
            self._task = self._bar.add_task("epoch", total=steps, completed=done, loss=float("nan"), rate=0.0)
            self._bar.start()
        self._done0 = done

    def update(self, done: int, loss: float, force: bool = False) -> None:
        """Show `done` closures of the epoch finished (at most every REFRESH_S seconds unless forced)."""
        if self._bar is None:
            return
        now = time.perf_counter()
        if not force and now - self._shown < self.REFRESH_S:
            return
        self._shown = now
        rate = (done - self._done0) / max(now - self._start, 1e-9)
        self._bar.update(self._task, completed=done, loss=loss, rate=rate)

    def stop(self) -> None:
        """End the bar (the epoch's closures are done)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def report(self, logs: Mapping[str, float]) -> None:
        """Print the epoch's logs, validation included."""
        if self.verbose:
            print(f"Epoch {self.epoch + 1}/{self.epochs}: {format_logs(logs)} "
                  f"({time.perf_counter() - self._start:.1f} s)", flush=True)
