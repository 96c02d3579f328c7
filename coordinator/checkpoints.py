"""Automatic checkpoints (TF's CheckpointManager + BackupAndRestore): a policy and its owner thread.

`decide(state, event, now)` is pure: every `every_steps` global steps and/or every `every_s` seconds
since the last save it returns a `Save(step)`; nothing when the step has not moved since the last
save. The `AutoCheckpointer` executor asks the PS tasks to save (each PS writes its shards under its
own shard locks while training goes on, like TF's per-PS saves) and feeds back `Saved` or `Refused`:
a PS without a checkpoint directory refuses once and the policy switches itself off, so the policy
is on by default and active exactly when the PS tasks have a checkpoint directory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pscluster.config import Settings
from pscluster.errors import FailedPreconditionError, PsclusterError

log = logging.getLogger(__name__)


@dataclass
class PolicyState:
    """What the policy decides from."""

    every_steps: int | None
    every_s: float | None
    last_step: int
    last_time: float
    enabled: bool = True


@dataclass(frozen=True)
class Tick:
    """The current global step."""

    step: int


@dataclass(frozen=True)
class Saved:
    """Every PS saved at `step`."""

    step: int


@dataclass(frozen=True)
class Refused:
    """A PS has no checkpoint directory."""


@dataclass(frozen=True)
class Save:
    """Action: checkpoint every PS at `step`."""

    step: int


def decide(state: PolicyState, event: Tick | Saved | Refused, now: float) -> list[Save]:
    """Update `state` with `event`; return the saves to perform."""
    if isinstance(event, Refused):
        state.enabled = False
        return []
    if isinstance(event, Saved):
        state.last_step = max(state.last_step, event.step)
        state.last_time = now
        return []
    if not state.enabled or event.step <= state.last_step:
        return []
    by_steps = state.every_steps is not None and event.step - state.last_step >= state.every_steps
    by_time = state.every_s is not None and now - state.last_time >= state.every_s
    return [Save(event.step)] if by_steps or by_time else []


def needs_step(state: PolicyState, now: float) -> bool:
    """Whether a tick now could save, so the global step is worth asking for: by steps always, by time only once
    every_s has passed (in a sync job the step is a GetStep on the token queue's PS, and the replica table's
    GetRoles on every PS before it: asked every tick, ~10 calls a second per PS for a save a minute)."""
    if not state.enabled:
        return False
    return state.every_steps is not None or (state.every_s is not None and now - state.last_time >= state.every_s)


class AutoCheckpointer:
    """Owns the `auto-checkpoint` thread: ticks the policy and performs its saves; `stop()` joins it."""

    def __init__(self, state: PolicyState, step: Callable[[], int], save: Callable[[int], object],
                 clock: Callable[[], float], on_fatal: Callable[[BaseException], None], poll_s: float = 0.1) -> None:
        self.state = state
        self._on_fatal = on_fatal
        self._step = step
        self._save = save
        self._clock = clock
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards `state` for readers (saved_step); never held across I/O
        self._thread = threading.Thread(target=self._loop, name="auto-checkpoint", daemon=True)

    @classmethod
    def from_settings(cls, settings: Settings, initial_step: int, step: Callable[[], int],
                      save: Callable[[int], object], clock: Callable[[], float],
                      on_fatal: Callable[[BaseException], None]) -> AutoCheckpointer | None:
        """A started checkpointer as the settings ask (None when automatic checkpoints are off)."""
        every = (settings.checkpoint_every_steps, settings.checkpoint_every_s)
        if not settings.auto_checkpoint or every == (None, None):
            return None
        policy = PolicyState(*every, last_step=initial_step, last_time=clock())
        return cls(policy, step=step, save=save, clock=clock, on_fatal=on_fatal).start()

    def start(self) -> AutoCheckpointer:
        """Start ticking."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread (a save in progress finishes first)."""
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def saved_step(self) -> int:
        """The newest step saved by this policy (or the step it started from)."""
        with self._lock:
            return self.state.last_step

    def _feed(self, event: Tick | Saved | Refused) -> list[Save]:
        with self._lock:
            return decide(self.state, event, self._clock())

    def _loop(self) -> None:
        try:
            self._ticks()
        except BaseException as exc:  # noqa: BLE001 - never end silently: join() raises it
            self._on_fatal(exc)

    def _ticks(self) -> None:
        while not self._stop.wait(self._poll_s) and self.state.enabled:
            with self._lock:
                wanted = needs_step(self.state, self._clock())
            if not wanted:
                continue
            try:
                actions = self._feed(Tick(self._step()))
            except PsclusterError as exc:  # a PS is down: the step is unknown now; try again later
                log.debug("auto-checkpoint: no step now: %s", exc)
                continue
            for action in actions:
                self._perform(action)

    def _perform(self, action: Save) -> None:
        try:
            self._save(action.step)
        except FailedPreconditionError as exc:
            log.warning("automatic checkpoints off: %s", exc)
            self._feed(Refused())
            return
        except PsclusterError as exc:  # a PS is down or restarting: the next tick tries again
            log.warning("automatic checkpoint at step %d failed (retried at the next tick): %s", action.step, exc)
            return
        self._feed(Saved(action.step))
        log.info("automatic checkpoint at step %d", action.step)
