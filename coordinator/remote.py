"""RemoteCoordinator: submit closures to a coordinator daemon from another process, same API.

    coord = RemoteCoordinator(load_settings("cluster.yaml"))
    v = coord.schedule(step, args=(it,)); coord.join(); print(v.fetch())
    # after a reconnect: coord.remote_value(v.closure_id).fetch()
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from pscluster import context, rpc
from pscluster.client import PSClient
from pscluster.config import Settings
from pscluster.coordinator.api import CoordinatorAPI
from pscluster.coordinator.values import RemoteValue, reply_error
from pscluster.errors import DeadlineExceededError, FailedPreconditionError, ResourceExhaustedError
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.closures import ClosureEncoder


class _RemoteValue(RemoteValue):
    """A RemoteValue whose result is long-polled from the coordinator daemon."""

    def __init__(self, closure_id: int, owner: RemoteCoordinator) -> None:
        super().__init__(closure_id)
        self._owner = owner

    def done(self) -> bool:
        """True once the closure has finished on the daemon (asks it when not known here yet)."""
        if not super().done():
            reply = self._owner._call("Fetch", pb.FetchRequest(closure_id=self.closure_id, timeout_s=0))
            if reply.done:
                self._set_reply(reply.reply)
        return super().done()

    def fetch(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not super().done():
            wait = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._owner._poll("Fetch", pb.FetchRequest(closure_id=self.closure_id, timeout_s=wait))
            if reply is not None and reply.done:
                self._set_reply(reply.reply)
            elif deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"closure {self.closure_id} not finished after {timeout} s")
        return super().fetch(0)


class RemoteCoordinator(CoordinatorAPI):
    """Client of a `pscluster coordinator` daemon with ClusterCoordinator's API."""

    def __init__(self, settings: Settings) -> None:
        if settings.cluster.coordinator is None:
            raise FailedPreconditionError("the cluster spec names no coordinator address")
        self.settings = settings
        self._channel = rpc.open_channel(settings.cluster.coordinator, settings)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._encoder = ClosureEncoder()
        self._busy = 0.0  # backoff after RESOURCE_EXHAUSTED long polls
        self.client = PSClient(settings)
        context.set_default_client(self.client)

    def _call(self, method: str, request: Any) -> Any:
        return rpc.call(getattr(self._stub, method), request, timeout=60.0, what=f"coordinator {method}",
                        retry_for=30.0)

    def _poll(self, method: str, request: Any) -> Any | None:
        """One long poll (Join/Fetch); None when the daemon has no free poll slot (after a short backoff).

        The daemon caps concurrent long polls to keep threads for heartbeats (see clients.py) and
        answers RESOURCE_EXHAUSTED beyond the cap: that means "not done yet", so callers poll again.
        """
        try:
            reply = self._call(method, request)
        except ResourceExhaustedError:
            self._busy = min(max(2 * self._busy, 0.02), 0.5)
            time.sleep(self._busy * (0.5 + random.random()))
            return None
        self._busy = 0.0
        return reply

    def schedule(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Submit fn(*args, **kwargs) to the coordinator daemon; returns a RemoteValue."""
        reply = self._call("Schedule", pb.ScheduleRequest(payload=self._encoder.encode(fn, tuple(args), dict(kwargs or {}))))
        return _RemoteValue(reply.closure_id, self)

    def remote_value(self, closure_id: int) -> RemoteValue:
        """Re-attach to a closure scheduled earlier (e.g. by a previous connection)."""
        return _RemoteValue(closure_id, self)

    def join(self, timeout: float | None = None) -> None:
        """Wait for everything scheduled on the daemon; raise the first closure error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._poll("Join", pb.JoinRequest(timeout_s=wait))
            if reply is not None and reply.done:
                if reply.HasField("error"):
                    raise reply_error(reply.closure_id_of_error, reply.error)
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"join: closures still outstanding after {timeout} s")

    def done(self) -> bool:
        """True when the daemon has nothing outstanding."""
        reply = self._call("Join", pb.JoinRequest(timeout_s=0))
        if reply.done and reply.HasField("error"):
            raise reply_error(reply.closure_id_of_error, reply.error)
        return bool(reply.done)

    def status(self) -> pb.CoordinatorStatus:
        """The daemon's queue, counters and workers."""
        return self._call("Status", pb.CoordinatorStatusRequest())

    def close(self) -> None:
        """Close connections."""
        self._channel.close()
        self.client.close()
