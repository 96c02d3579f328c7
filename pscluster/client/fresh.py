"""Values a fused push-pull brought back, kept on a worker for its next pull of the same variables.

In an async job with `push_pull`, a closure's push asks each PS for the pushed shards' values as they
are right after its gradient was applied (one round trip instead of a push and then a pull, ps-lite's
PushPull). The next `pull` on this worker of exactly those variables takes them instead of asking
the PS tasks again: what it reads is the PS state right after this worker's previous push, never older
than `max_age_s`, each value served once. Async SGD reads that are one push behind are what a pull
racing the other workers' pushes sees anyway; sync and bounded jobs never use this (their PS tasks
accumulate and answer without values).

Memory: at most one array per variable this worker pushed, replaced on every push.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np


class FreshValues:
    """Variable name -> (value after this worker's last push of it, when it arrived)."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._values: dict[str, tuple[np.ndarray, float]] = {}
        self._lock = threading.Lock()
        self.served = 0  # pulls answered from here (tests and metrics read it)

    def put(self, values: Mapping[str, np.ndarray]) -> None:
        """Keep the values of one fused push-pull (they replace older ones)."""
        now = time.monotonic()
        with self._lock:
            for name, value in values.items():
                self._values[name] = (value, now)

    def take(self, names: Sequence[str]) -> list[np.ndarray] | None:
        """The values of `names` if every one is here and young enough (then they are gone), else None.

        Either way the entries of `names` are dropped: a pull that goes to the PS tasks reads newer values.
        """
        now = time.monotonic()
        with self._lock:
            found = [self._values.pop(name, None) for name in names]
            if any(f is None or now - f[1] > self.max_age_s for f in found) or len(set(names)) != len(names):
                return None
            self.served += 1
        return [f[0] for f in found if f is not None]

    def clear(self) -> None:
        """Forget everything (a PS moved or restarted)."""
        with self._lock:
            self._values.clear()
