"""The gRPC channels of a client to its PS tasks, as one value a transport is handed.

A transport needs the stubs, the fan-out pool and a few settings; it gets them here instead of reaching
into the client. Every call makes one attempt and raises the mapped PsclusterError: the client retries,
once, around the whole operation (so `retry_for` is what a caller waits).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from pscluster.config import Settings
from pscluster.errors import UnavailableError
from pscluster.net import rpc
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

Call = tuple[int, str, Any]  # (PS task, method name, request)
STALL_CHECK_S = 0.1  # as the bulk path's (pscluster/net/bulk.py): a Push or Pull without a reply asks this often


class Channels:
    """One channel and stub per PS task (swapped when a PS moves), and the pool that fans calls out."""

    def __init__(self, settings: Settings, addresses: Sequence[str]) -> None:
        self.settings = settings
        self.addresses = list(addresses)
        self._channels = [rpc.open_channel(addr, settings) for addr in self.addresses]
        self._retired: list[grpc.Channel] = []  # channels of PS tasks that moved, closed a few moves later
        self.stubs = [pb_grpc.ParameterServerStub(ch) for ch in self._channels]
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.stubs)), thread_name_prefix="ps-stream")
        self._lock = threading.Lock()
        # replicas: 2: stalled(ps, request) says a Push or Pull still unanswered is to be given up: the replica
        # table moved its shards off a PS that stopped answering (SIGSTOP); else it waits rpc_timeout_s
        self.stalled: Callable[[int, Any], bool] | None = None

    def what(self, ps: int, method: str) -> str:
        """How errors name a call: 'ps 1 (127.0.0.1:7001) Push'."""
        return f"ps {ps} ({self.addresses[ps]}) {method}"

    def call(self, ps: int, method: str, request: Any, timeout: float | None = None) -> Any:
        """One attempt of a unary call.

        Raises:
            PsclusterError: the call's mapped status.
        """
        return rpc.call(getattr(self.stubs[ps], method), request, what=self.what(ps, method),
                        timeout=self.settings.rpc_timeout_s if timeout is None else timeout)

    def bulk_port(self, ps: int) -> int:
        """PS ps's bulk-tensor port, from its Status (one attempt)."""
        return int(self.call(ps, "Status", pb.PsStatusRequest()).bulk_port)

    def gather(self, calls: Sequence[Call]) -> list[Any]:
        """One attempt of each unary call, all in parallel; replies in call order.

        Raises:
            PsclusterError: the first failed call's mapped status (after every call has finished).
        """
        futs = [getattr(self.stubs[ps], m).future(req, timeout=self.settings.rpc_timeout_s) for ps, m, req in calls]
        out, first = [], None
        for (ps, method, req), fut in zip(calls, futs):
            try:
                out.append(self.result(fut, ps, method, req))
            except grpc.RpcError as exc:
                first = first or rpc.translate(exc, self.what(ps, method))
            except UnavailableError as exc:
                first = first or exc
        if first is not None:
            raise first from None  # the status says it all; grpc's own frames only bury it
        return out

    def result(self, fut: Any, ps: int, method: str, request: Any, cancel: Callable[[], object] | None = None) -> Any:
        """fut's reply (a gRPC future, or a pool future draining a stream); a Push or Pull to a PS the replica
        table no longer lists for its shards is given up: `cancel` (default fut.cancel) ends the call.

        Raises:
            UnavailableError: the call was given up (retryable: the retry goes to the shards' new primary).
        """
        if self.stalled is None or method not in ("Push", "Pull"):
            return fut.result()
        while True:
            try:
                return fut.result(timeout=STALL_CHECK_S)
            except (grpc.FutureTimeoutError, FutureTimeout):
                if self.stalled(ps, request):
                    (cancel or fut.cancel)()
                    raise UnavailableError(f"{self.what(ps, method)}: no reply and the replica table moved its "
                                           "shards to another PS; retry there") from None

    def move(self, ps: int, address: str) -> bool:
        """PS ps now listens at address: open a channel there. False if it was already there."""
        with self._lock:
            if not address or address == self.addresses[ps]:
                return False
            # the old channel stays open a while: another thread may be calling through it right now
            self._retired.append(self._channels[ps])
            stale = self._retired[:-8]
            del self._retired[:-8]
            self.addresses[ps] = address
            self._channels[ps] = rpc.open_channel(address, self.settings)
            self.stubs[ps] = pb_grpc.ParameterServerStub(self._channels[ps])
        for channel in stale:
            channel.close()
        return True

    def resize(self, addresses: Sequence[str]) -> list[int]:
        """Follow the coordinator's PS list (a PS joined or left, docs/elastic.md): open channels to new PS
        tasks, retire those of tasks that left; the PS tasks whose address is new."""
        changed = [ps for ps in range(min(len(addresses), len(self.addresses))) if self.move(ps, addresses[ps])]
        with self._lock:
            for ps in range(len(self.addresses), len(addresses)):
                self.addresses.append(addresses[ps])
                self._channels.append(rpc.open_channel(addresses[ps], self.settings))
                self.stubs.append(pb_grpc.ParameterServerStub(self._channels[-1]))
                changed.append(ps)
            while len(self.addresses) > len(addresses):  # the last tasks left: nothing routes there any more
                self.addresses.pop()
                self.stubs.pop()
                self._retired.append(self._channels.pop())
        return changed

    def close(self) -> None:
        """Close every channel and stop the pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels + self._retired:
            ch.close()
