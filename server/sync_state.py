"""replicas: 2 for the sync state: its primary forwards it whole after each change, its backup takes it.

A mixin of sync_replicas.SyncReplicas (which owns the lock, the state and the core; see its docstring):
the primary's side (`_changed` under the lock, `_replicated` after it, `send_state` for a new backup's
catch-up) and the backup's (`install`), plus `roles_changed` for server/replica_notes.py's SyncStateHolder.

Each forward costs the primary a round trip to the backup before its reply, so it forwards only what changed:
a call that changed nothing (a take that waits, a repeated report, a retried take of a held token) forwards
nothing and its reply waits only for the last forward; and a report that lets waiting takes through decides
those takes itself (`_grant_waiting`), so one forward carries the report and the grants, and every reply
waits for that one confirmation (before, each woken take forwarded and waited on its own, one after another).

A report's reply does not wait for its forward: nothing a reply tells depends on the report alone (a take it lets
through waits for a state that holds it), so its forward goes with the next take's (superseded in the queue) or
after LINGER_S. If the primary dies first, the new primary lacks the report; the StepDone reply says at which
(epoch, version) it was counted, the closure's reply carries that to the coordinator, and coordinator/sync_reports.py
sends it again to the new primary (a retried report counts once) unless the backup had confirmed that version.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any, cast

from pscluster.server import sync_tokens as tok
from pscluster.server.ps import ParameterServerCore

from pscluster.errors import InvalidArgumentError
from pscluster.placement import SYNC_STATE_KEY


class SyncStateCopies:
    """The sync state's replication (mixed into SyncReplicas, which sets these attributes)."""

    core: ParameterServerCore
    _cond: threading.Condition
    _state: tok.TokenState
    _clock: Callable[[], float]
    # changes of the token state made here (primary) or the newest taken (backup): the forwards' sequence;
    # `_held`: (epoch, version) of the last forward taken as backup
    version: int
    _held: tuple[int, int]
    _sent: tuple[int, str] | None  # (G, the state's repr) last forwarded: an unchanged state is not sent again
    _sent_epoch: int  # the epoch that forward went at (0: this PS is not the state's primary)
    _waiting: dict[int, tuple[str, tok.Mode]]  # closures waiting for a token: closure -> (worker, its wait's mode)
    _pregranted: dict[int, tuple[int, int]]  # their grants decided by a report (`_grant_waiting`): (step, replica)

    def _replication(self) -> Any:
        """The core's Replication (a SyncStateHolder's peer), or None with one copy."""
        return self.core.replication

    def _changed(self, replication: Any, waited: bool = True) -> int:
        """Under self._cond, after a change: forward the whole state if this PS is its primary; returns the
        version the reply must see confirmed (0: nothing to wait for), forwarded at `_sent_epoch`. waited=False:
        no reply waits for it."""
        if replication is None or not replication.is_primary(SYNC_STATE_KEY):
            self._sent_epoch = 0
            return 0
        mark = (self.core.global_step, repr(self._state))
        if mark == self._sent:
            return self.version  # nothing changed: the reply waits for the forward of what it saw
        self._sent = mark
        self.version += 1
        self._sent_epoch = replication.forward_sync(self.version, self._wire(), waited=waited)
        return self.version

    def _grant_waiting(self, replication: Any) -> None:
        """Under self._cond, after a report on the primary: decide the takes waiting now (as each would on waking:
        the same event), so that the report's one forward carries their grants; each waiter picks its grant up
        and waits for that forward (`_pregranted`)."""
        if replication is None or not self._waiting or not replication.is_primary(SYNC_STATE_KEY):
            return
        for closure_id, (worker, mode) in list(self._waiting.items()):
            [answer] = tok.decide(self._state, tok.RetryToken(closure_id, worker, self.core.global_step, mode),
                                  self._clock())
            if isinstance(answer, tok.Grant):
                del self._waiting[closure_id]
                self._pregranted[closure_id] = (answer.step, answer.replica)

    def _wire(self) -> str:
        return json.dumps(tok.to_wire(self._state, self.core.global_step, self._clock()))

    @staticmethod
    def _replicated(replication: Any, version: int) -> None:
        """Return once the backup holds the state up to `version` (not under self._cond: it may send)."""
        if version:
            replication.wait([(SYNC_STATE_KEY, version)])

    def _check_holder(self, replication: Any) -> None:
        if replication is not None:
            replication.check_primary([SYNC_STATE_KEY])  # UnavailableError: the client re-reads the table

    def _admitted(self, replication: Any) -> contextlib.AbstractContextManager[None]:
        """A token call on the queue's primary, held in flight for a move's freeze (server/handoff.py): while
        the queue moves to another PS (elastic.py) a new call gets a retryable "moving" error."""
        if replication is None:
            return contextlib.nullcontext()
        return cast("contextlib.AbstractContextManager[None]", self.core.gate.admit([SYNC_STATE_KEY]))

    def current_version(self) -> int:
        """The newest change of the state made here (what a move's drain waits for the backup to hold)."""
        with self._cond:
            return self.version

    def send_state(self) -> None:
        """The whole state for a new backup (a catch-up), queued in order with the changes."""
        replication = self._replication()
        with self._cond:
            if replication is not None:
                replication.forward_sync(self.version, self._wire(), catch_up=True)

    def install(self, epoch: int, version: int, state: str) -> None:
        """Take the primary's forwarded state unless an equal or newer one is held (a resend); a new epoch's
        catch-up replaces whatever this PS held before (a deposed primary's own changes included).

        Raises:
            InvalidArgumentError: a malformed state (nothing changes).
        """
        try:
            data = json.loads(state)
        except ValueError as exc:
            raise InvalidArgumentError(f"a replicated sync state is not JSON: {exc}") from exc
        taken, step = tok.from_wire(data, self._clock())
        with self._cond:
            if (epoch, version) <= self._held:
                return
            self._held, self.version = (epoch, version), version
            self._state, self._sent = taken, None
            self.core.global_step = step
            self._cond.notify_all()

    def roles_changed(self) -> None:
        """Wake token waiters: a deposed holder's waiters give up (the client retries on the new one)."""
        with self._cond:
            self._sent = None  # a promoted backup forwards its first change whatever it was (a new `_sent_epoch`)
            self._cond.notify_all()

