"""Training curves: what closures report (pscluster.report) and closures/s, as TensorBoard event files.

The coordinator loop only adds a finished closure's scalars to running sums (`add`, a dict update
under a small lock); the curves thread wakes every `interval_s`, takes the sums, and writes one point
per name: the mean over the interval of what closures reported (`train/<name>`), and
`train/closures_per_s`. The x axis is the number of closures completed, the step a TF user's
`iterations` counts in a one-step-per-closure loop. Hyper-parameters the driver set (set_learning_rate)
are written as `hparams/<name>` at every interval from the change on. Memory is one pair of numbers per name: nothing
grows with the steps taken. Event files go to `<logdir>/train` (tensorboardX writes them; its queue
and file I/O stay on this thread, never the loop's).
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


class TrainingCurves:
    """Interval means of reported scalars, written as TensorBoard scalars by an owned thread."""

    def __init__(self, logdir: pathlib.Path, interval_s: float = 5.0) -> None:
        from tensorboardX import SummaryWriter  # an optional extra's import, only with a logdir

        self.path = logdir / "train"
        self._writer: Any = SummaryWriter(str(self.path), flush_secs=max(1, int(interval_s)))
        self._interval = interval_s
        self._lock = threading.Lock()
        self._sums: dict[str, tuple[float, int]] = {}
        self._hparams: dict[str, float] = {}  # one value per name the driver set: bounded by its calls
        self._hparams_changed = False
        self._closures = 0
        self._written_closures = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-curves", daemon=True)
        self._thread.start()

    def add(self, scalars: Mapping[str, float]) -> None:
        """One closure completed, having reported scalars (means over the closure)."""
        with self._lock:
            self._closures += 1
            for name, value in scalars.items():
                total, count = self._sums.get(name, (0.0, 0))
                self._sums[name] = (total + value, count + 1)

    def hyperparameters(self, values: Mapping[str, float]) -> None:
        """Values the driver set (set_learning_rate, ...): written as `hparams/<name>` from now on, every interval."""
        with self._lock:
            self._hparams.update(values)
            self._hparams_changed = True

    def stop(self) -> None:
        """Write what is pending, close the event file, join the thread."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._write()
        self._writer.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._write()
            except Exception:
                log.exception("training curves: writing %s failed", self.path)

    def _write(self) -> None:
        now = time.monotonic()
        with self._lock:
            sums, self._sums = self._sums, {}
            closures, elapsed = self._closures, now - self._last
            self._last = now
            hparams, changed = dict(self._hparams), self._hparams_changed
            self._hparams_changed = False
        done = closures - self._written_closures
        if done == 0 and not sums and not changed:
            return
        self._written_closures = closures
        for name, (total, count) in sorted(sums.items()):
            self._writer.add_scalar(f"train/{name}", total / count, closures)
        for name, value in sorted(hparams.items()):
            self._writer.add_scalar(f"hparams/{name}", value, closures)
        if elapsed > 0:
            self._writer.add_scalar("train/closures_per_s", done / elapsed, closures)
        self._writer.flush()
