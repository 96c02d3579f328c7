"""Cluster-wide operations of a PS client: update mode, checkpoints, status, hyper-parameters, export.

They are fan-outs of one unary call per PS task; PSClient (client.py) supplies the fan-out, variable
discovery and pulls, and keeps the data path (pull, push, tokens) to itself.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from pscluster import codec
from pscluster.client.routes import Routes
from pscluster.client.variables import Variable
from pscluster.errors import InvalidArgumentError, NotFoundError, PsclusterError, UnavailableError
from pscluster.optimizer_config import changes_to_json
from pscluster.placement import SYNC_STATE_KEY
from pscluster.proto import pscluster_pb2 as pb
from pscluster.tables import write_export

T = TypeVar("T")

# how long a checkpoint retries a PS that is down before saving from the live copies (replicas: 2)
SAVE_RETRY_S = 2.0
# how often a checkpoint whose save on some PS has not answered asks the replica table whether that PS still holds
# a copy (replicas: 2): a SIGSTOPped PS is marked down in ~0.5 s and its save given up then, not after rpc_timeout_s
SAVE_CHECK_S = 0.25
log = logging.getLogger(__name__)


def uncovered_shards(shards: set[tuple[str, int]], saved: dict[int, set[tuple[str, int]]]) -> list[tuple[str, int]]:
    """The shards of the replica table (the sync state's row aside: not a shard) that no task's save wrote."""
    written = set().union(*saved.values()) if saved else set()
    return sorted(k for k in shards if k != SYNC_STATE_KEY and k not in written)


# rows per ReadTable page of an export (the PS caps it too: server/table_ops.py)
EXPORT_PAGE_ROWS = 1 << 15


class ClusterOperations(ABC):
    """Operations on every PS task at once, over a client's fan-out."""

    routes: Routes | None  # with replicas: 2, where each shard's primary is

    @abstractmethod
    def _call(self, ps: int, method: str, request: Any, retry_for: float | None = None) -> Any:
        """One unary call to PS task ps (retried while retryable)."""

    @abstractmethod
    def _start(self, ps: int, method: str, request: Any) -> Any:
        """One unary call to PS task ps, started: its grpc future (with the client's deadline)."""

    @abstractmethod
    def _translate(self, ps: int, method: str, exc: Exception) -> PsclusterError:
        """A failed call's error, as the client raises it."""

    @abstractmethod
    def _retrying(self, fn: Callable[[], T]) -> T:
        """fn, retried on retryable errors with the replica routes refreshed between tries."""

    @property
    @abstractmethod
    def num_ps(self) -> int:
        """Number of PS tasks."""

    @abstractmethod
    def _gather(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Unary calls in parallel, replies in call order."""

    @abstractmethod
    def discover(self) -> dict[str, Variable]:
        """Every variable on the cluster."""

    @abstractmethod
    def pull(self, variables: Sequence[Variable]) -> list[np.ndarray]:
        """Current values of variables."""

    def configure_sync(self, mode: str, replicas_to_aggregate: int = 1, total_num_replicas: int = 0,
                       staleness: int = 0) -> int:
        """Set the update mode on every PS task; returns the global step."""
        req = pb.SyncConfigRequest(mode=mode, replicas_to_aggregate=replicas_to_aggregate,
                                   total_num_replicas=total_num_replicas or replicas_to_aggregate, staleness=staleness)
        return int(self._gather([(ps, "ConfigureSync", req) for ps in range(self.num_ps)])[0].global_step)

    def configure_sync_on(self, ps: int, config: pb.SyncConfigRequest, retry_for: float | None = None) -> int:
        """Set the update mode on one PS task (one that joined the PS list after configure_sync: elastic PS);
        returns its global step. retry_for: how long an unavailable PS is retried (None: the client's)."""
        return int(self._call(ps, "ConfigureSync", config, retry_for=retry_for).global_step)

    @abstractmethod
    def sync_ps(self) -> int:
        """The PS holding the sync token queue and global step now."""

    def sync_step(self) -> pb.StepReply:
        """The global step, mode and clocks of the token queue's PS (PS 0; with replicas: 2 the primary of its
        row), with stale drops summed over every PS (with replicas: 2, over those that answer)."""
        if self.routes is None:
            replies = self._gather([(ps, "GetStep", pb.StepRequest()) for ps in range(self.num_ps)])
            first: pb.StepReply = replies[0]
            first.dropped_stale = sum(r.dropped_stale for r in replies)
            return first
        self.routes.refresh()  # a failover may have moved the token queue since this client last looked
        holder = self._retrying(lambda: (ps := self.sync_ps(), self._call(ps, "GetStep", pb.StepRequest(),
                                                                           retry_for=0.0)))
        reply: pb.StepReply = holder[1]
        dropped = reply.dropped_stale
        for ps in range(self.num_ps):
            if ps != holder[0]:
                try:
                    dropped += self._call(ps, "GetStep", pb.StepRequest(), retry_for=0.0).dropped_stale
                except PsclusterError:
                    pass  # down (a backup holds its shards): its drops come back with it
        reply.dropped_stale = dropped
        return reply

    def checkpoint(self, step: int) -> list[str]:
        """Write a checkpoint of every PS task at `step` (call with pushes quiesced for consistency).

        With replicas: 2 a PS task that is down does not stop it while each shard has a live copy: the live
        tasks save theirs, and one of them writes an empty file for each down task, which completes the step
        (restore finds every shard in whichever file of the step holds it)."""
        if self.routes is None:
            replies = self._gather([(ps, "Save", pb.SaveRequest(step=step)) for ps in range(self.num_ps)])
            return [r.path for r in replies]
        outcomes = self._saves(self.routes, pb.SaveRequest(step=step))
        down = {ps: err for ps, err in enumerate(outcomes) if isinstance(err, PsclusterError)}
        if not down:
            return [r.path for r in outcomes if isinstance(r, pb.SaveReply)]
        saved = {ps: {(ref.variable, ref.shard_index) for ref in r.saved}
                 for ps, r in enumerate(outcomes) if isinstance(r, pb.SaveReply)}
        first = next(iter(down.values()))
        if not saved or any(not err.retryable for err in down.values()):
            raise first
        roles = [self._call(ps, "GetRoles", pb.GetRolesRequest()) for ps in saved]
        newest = max(roles, key=lambda r: r.version)
        uncovered = uncovered_shards({(r.ref.variable, r.ref.shard_index) for r in newest.roles}, saved)
        if uncovered:
            raise type(first)(f"checkpoint at step {step}: PS tasks {sorted(down)} are down and no live task "
                              f"saved {uncovered[:5]} ({len(uncovered)} shards): {first}")
        writer = min(saved)
        self._call(writer, "Save", pb.SaveRequest(step=step, absent=sorted(down)), SAVE_RETRY_S)
        log.warning("checkpoint at step %d: PS tasks %s are down; ps %d wrote their empty files (every shard has "
                    "a saved live copy)", step, sorted(down), writer)
        return [r.path for r in outcomes if isinstance(r, pb.SaveReply)]

    def _saves(self, routes: Routes, request: pb.SaveRequest) -> list[pb.SaveReply | PsclusterError]:
        """request on every PS task at once, each one's reply or error. A save that failed within SAVE_RETRY_S
        of the start is retried until then; one still waiting on a PS that answered no GetRoles in two table
        refreshes in a row and that the table lists no copy on (down: SIGSTOPped) is given up as unavailable
        and its call cancelled: the checkpoint completes from the live copies (`checkpoint`). A live PS, or one
        holding a copy, is waited for."""
        started = time.monotonic()
        futures: list[Any] = []
        try:
            futures += [self._start(ps, "Save", request) for ps in range(self.num_ps)]
            answered = threading.Event()
            for fut in futures:
                fut.add_done_callback(lambda _: answered.set())
            outcomes: dict[int, pb.SaveReply | PsclusterError] = {}
            silent: dict[int, int] = {}  # refreshes in a row a PS answered no GetRoles in
            while True:
                answered.clear()  # before looking: an answer after the look sets it again
                for ps, fut in enumerate(futures):
                    if ps not in outcomes and fut.done():
                        outcomes[ps] = self._saved(ps, fut, request, started + SAVE_RETRY_S)
                if len(outcomes) == len(futures):
                    return [outcomes[ps] for ps in range(len(futures))]
                if answered.wait(SAVE_CHECK_S):
                    continue
                routes.refresh()
                for ps in range(len(futures)):
                    silent[ps] = 0 if ps in routes.live else silent.get(ps, 0) + 1
                    if ps not in outcomes and routes.version and ps not in routes.holders and silent[ps] >= 2:
                        outcomes[ps] = UnavailableError(f"ps {ps} answers neither its save nor GetRoles, and the "
                                                        f"replica table (version {routes.version}) holds no copy "
                                                        "on it: down")
        finally:
            for fut in futures:
                fut.cancel()  # given up (a stopped PS): its call ends here, not at its deadline

    def _saved(self, ps: int, fut: Any, request: pb.SaveRequest, retry_until: float) -> pb.SaveReply | PsclusterError:
        """A finished save's reply, or its error (a retryable one retried until retry_until)."""
        try:
            reply: pb.SaveReply = fut.result()
            return reply
        except Exception as exc:  # noqa: BLE001 - a grpc.RpcError: translated as the client's calls are
            err = self._translate(ps, "Save", exc)
        left = retry_until - time.monotonic()
        if not err.retryable or left <= 0:
            return err  # a save that timed out after rpc_timeout_s is not tried again for as long
        try:
            retried: pb.SaveReply = self._call(ps, "Save", request, left)
            return retried
        except PsclusterError as again:
            return again

    def table_stats(self, table: Variable) -> dict[str, int]:
        """A dynamic table's live keys, evicted keys and dropped (not admitted) gradient rows, summed
        over its shards, each counted once (one ListShards per PS task)."""
        self._check_table(table, "table_stats")
        totals = {"live_keys": 0, "evicted_keys": 0, "dropped_rows": 0}
        # with replicas: 2 a shard is listed by its primary and its backup: count the copy furthest ahead once
        newest: dict[int, pb.ShardInfo] = {}
        for reply in self._gather([(ps, "ListShards", pb.ListShardsRequest()) for ps in range(self.num_ps)]):
            for info in reply.shards:
                seen = newest.get(info.spec.shard_index)
                if info.spec.variable == table.name and (seen is None or info.version > seen.version):
                    newest[info.spec.shard_index] = info
        if not newest:
            raise NotFoundError(f"table_stats: no PS task holds {table.name!r}")
        for info in newest.values():
            for name in totals:
                totals[name] += getattr(info, name)
        return totals

    def evicted_keys(self, table: Variable) -> tuple[np.ndarray, int]:
        """Every key the dynamic table evicted since the last call (sorted; a key evicted twice is listed
        twice), and how many more were evicted but not kept because a shard's report was full
        (TableConfig.report_evicted): 0 means none went unlisted. Each call empties the reports."""
        self._check_table(table, "evicted_keys")
        replies = self._gather([(ps, "EvictedKeys", pb.EvictedKeysRequest(variable=table.name))
                                for ps in range(self.num_ps)])
        keys = np.sort(np.concatenate([codec.decode(r.keys, "evicted keys") for r in replies]))
        return keys, sum(int(r.overflowed) for r in replies)

    def evict(self, table: Variable) -> int:
        """Run the dynamic table's eviction policy on every shard now (the on-demand trigger); returns how many
        keys it evicted, which `evicted_keys` then lists. With replicas: 2 each backup has evicted the same
        keys when this returns."""
        self._check_table(table, "evict")
        replies = self._gather([(ps, "Evict", pb.EvictRequest(variable=table.name)) for ps in range(self.num_ps)])
        return sum(int(r.evicted) for r in replies)

    def export_table(self, table: Variable, directory: str | pathlib.Path,
                     float16: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
        """Write a dynamic table for serving: `NAME.keys` (int64, sorted) and `NAME.values` (its rows in that
        order, float16 if asked) as .npy files in directory, read a page at a time from every shard's
        primary. Quiesce pushes first (as for checkpoint()): pages are read between pushes, not at once."""
        self._check_table(table, "export_table")
        pathlib.Path(directory).mkdir(parents=True, exist_ok=True)  # before reading every page, not after
        keys, values = [], []
        for pl in table.shards:
            key = (table.name, pl.shard_index)
            ref = pb.ShardRef(variable=table.name, shard_index=pl.shard_index)
            start = 0
            while start >= 0:
                req = pb.ReadTableRequest(ref=ref, start=start, max_rows=EXPORT_PAGE_ROWS, float16=float16)

                def read(req: pb.ReadTableRequest = req, key: tuple[str, int] = key, home: int = pl.ps) -> Any:
                    # with replicas, the shard's primary now (a retry after a promotion reads the new one)
                    ps = home if self.routes is None else self.routes.primary.get(key, home)
                    return self._call(ps, "ReadTable", req, retry_for=1.0)

                reply = self._retrying(read)
                keys.append(codec.decode(reply.keys, "table keys"))
                values.append(codec.decode(reply.values, "table rows"))
                start = int(reply.next)
        all_keys = np.concatenate(keys)
        order = np.argsort(all_keys, kind="stable")
        rows = np.concatenate(values).reshape(-1, table.shape[1])[order]
        return write_export(all_keys[order], rows, pathlib.Path(directory), table.name, float16)

    @staticmethod
    def _check_table(table: Variable, what: str) -> None:
        if not table.dynamic:
            raise InvalidArgumentError(f"{what}: {table.name} is not a dynamic table (shape (None, dim), sparse=True)")

    def set_hyperparameters(self, changes: dict[str, Any], variables: Sequence[str] | None = None) -> int:
        """Change optimizer hyper-parameters (learning_rate, schedule, weight_decay, ...) of `variables` (every
        variable when None) on every PS task, from each shard's next update; returns the shards changed.

        Every task validates first (a dry run), so a change one task refuses changes nothing anywhere.

        Raises:
            NotFoundError: a named variable is on no PS task.
            InvalidArgumentError: an unknown or unchangeable hyper-parameter, or a bad value.
        """
        names = list(variables or [])
        text = changes_to_json(changes)
        checks = self._gather([(ps, "SetHyperparameters",
                                pb.HyperparametersRequest(variables=names, changes_json=text, dry_run=True))
                               for ps in range(self.num_ps)])
        missing = set(names) - {v for r in checks for v in r.variables}
        if missing:
            raise NotFoundError(f"set_hyperparameters: no PS task holds {', '.join(sorted(missing))}")
        replies = self._gather([(ps, "SetHyperparameters", pb.HyperparametersRequest(variables=names, changes_json=text))
                                for ps in range(self.num_ps)])
        return sum(int(r.shards) for r in replies)

    def status(self) -> list[pb.PsStatus]:
        """Status of every PS task."""
        return self._gather([(ps, "Status", pb.PsStatusRequest()) for ps in range(self.num_ps)])

    def export(self, path: str) -> dict[str, tuple[int, ...]]:
        """Write every variable, whole, to one safetensors file readable without pscluster (dynamic tables,
        which have no whole value, are left out: export_table writes them)."""
        from safetensors.numpy import save_file

        variables = self.discover()
        names = sorted(n for n, v in variables.items() if not v.dynamic)
        values = self.pull([variables[n] for n in names])
        save_file(dict(zip(names, values)), path, metadata={"format": "pscluster-export"})
        return {n: v.shape for n, v in zip(names, values)}
