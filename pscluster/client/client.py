"""The PS client (ps-lite's shape): create variables, pull/push them with per-PS fan-out in parallel.

Placement and sharding stay inside the client: callers see whole variables. Small shards of one
request travel in one unary RPC per PS task; shards above `stream_threshold_bytes` are streamed in
`chunk_bytes` chunks. Every push carries an id (exactly-once), so retries after UNAVAILABLE are safe.

    client = PSClient(settings)
    w = client.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=SGD(0.1))
    client.push([(w, grad)]); value = client.pull([w])[0]
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from pscluster import codec, gradients
from pscluster.client import context, plans
from pscluster.client.cluster_ops import ClusterOperations
from pscluster.client.fresh import FreshValues
from pscluster.client.routes import Routes, retry_wait
from pscluster.client.variables import ShardPlacement, Variable, missing_here, refuse_redefinition
from pscluster.config import Settings
from pscluster.errors import (
    InvalidArgumentError,
    NonFiniteGradientError,
    NotFoundError,
    PsclusterError,
    UnavailableError,
)
from pscluster.net import rpc, tls
from pscluster.net.bulk import BulkClient, BulkTensors
from pscluster.net.channels import Channels
from pscluster.net.grpc_tensors import GrpcTensors
from pscluster.net.transport import PullPlan, PushPlan, TensorTransport, ValueTargets
from pscluster.optimizer_config import optimizer_from_pb
from pscluster.placement import SYNC_STATE_KEY, Partitioner, ps_for_new_shard, ps_for_ordinal, split_rows
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.specs import OptimizerConfig, ShardSpec, spec_to_pb
from pscluster.tables import TableConfig, dynamic_config

Grads = plans.Grads
T = TypeVar("T")
log = logging.getLogger(__name__)


def _token_step(scope: context.ClosureScope | None, step: int = 0) -> int:
    """The step to tag a pull or push with: in a sync or bounded job, the closure's token step, taking its
    token now if it has none yet (a step's first pull is where a worker joins the step); else step."""
    token = scope.ensure_token() if scope is not None else None
    return token.step if token is not None else step


class PSClient(ClusterOperations):
    """Connections to every PS task, and the variable operations built on them."""

    def __init__(self, settings: Settings, retry_for: float = 5.0,
                 resolver: Callable[[int], str] | None = None) -> None:
        """Connect to the PS tasks of settings.cluster.ps.

        resolver: where PS i is now (host:port), asked when PS i stops answering; a PS that a scheduler
            restarted elsewhere (a Ray actor on another node) is then found without restarting the job.
        """
        self.settings = settings
        self.retry_for = retry_for
        self._resolver = resolver
        self._net = Channels(settings, settings.cluster.ps)
        self._lock = threading.Lock()
        self._known: dict[str, Variable] | None = None
        self._creating: dict[str, tuple[Variable, threading.Event]] = {}  # names whose shards are being created
        # this client's own definitions (CreateShard requests by PS), to create a shard again on a PS that
        # restarted from a checkpoint older than the variable: one entry per variable, not per step
        self._definitions: dict[str, list[tuple[int, str, Any]]] = {}
        self._optimizers: dict[str, OptimizerConfig] = {}  # per known variable, the optimizer it was made with
        self._timeout = settings.rpc_timeout_s
        self.fresh = FreshValues(settings.push_pull_max_age_s)  # fused push-pull values (pscluster/client/fresh.py)
        # replicas: 2: each shard's primary after failovers (pscluster/client/routes.py); None: the handles' placement
        self.routes = Routes(lambda: self.stubs, on_ps_list=self.set_ps_addresses) if settings.replica_table else None
        self._nonfinite = {"rejected": 0, "skipped": 0}  # pushes stopped by gradients.screen (worker metrics)
        self._tensors: TensorTransport = GrpcTensors(self._net)
        self._net.stalled = self.routes.moved_off if self.routes is not None else None
        if settings.bulk_transport:
            files = tls.files(settings)
            self._tensors = BulkTensors(BulkClient(
                [a.rpartition(":")[0] for a in settings.cluster.ps], self._net.bulk_port, settings.token_value(),
                settings.rpc_timeout_s, self._net.pool, io_timeout=settings.socket_timeout_s,
                tls_context=tls.client_context(files) if files else None, shared_memory=settings.shared_memory,
                stalled=self.routes.moved_off if self.routes is not None else None))

    @property
    def stubs(self) -> list[pb_grpc.ParameterServerStub]:
        """The gRPC stub of every PS task (a PS that moved has a new one)."""
        return self._net.stubs

    def address(self, ps: int) -> str:
        """Where PS ps listens now (host:port of its gRPC server; it changes when a PS moves)."""
        return self._net.addresses[ps]

    @property
    def num_ps(self) -> int:
        """Number of PS tasks."""
        return len(self.stubs)

    def close(self) -> None:
        """Close channels, bulk connections and the stream pool."""
        self._tensors.close()
        self._net.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, ps: int, method: str, request: Any, retry_for: float | None = None) -> Any:
        budget = self.retry_for if retry_for is None else retry_for
        deadline = time.monotonic() + budget
        while True:
            try:  # with a resolver, retries come in short rounds, asking between them where the PS is
                return rpc.call(getattr(self.stubs[ps], method), request, timeout=self._timeout,
                                what=self._net.what(ps, method),
                                retry_for=min(budget, 1.0) if self._resolver is not None else budget)
            except PsclusterError as err:
                if not (err.retryable and self._resolver is not None and time.monotonic() < deadline):
                    raise
                self.relocate(ps)

    def relocate(self, ps: int) -> bool:
        """Ask the resolver where PS ps is; if it moved, reconnect there. True if it moved."""
        if self._resolver is None:
            return False
        try:
            address = self._resolver(ps)
        except Exception as exc:  # noqa: BLE001 - the directory may be restarting too: the next round asks again
            log.warning("ps %d: cannot resolve its address (%s)", ps, exc)
            return False
        if not self._net.move(ps, address):
            return False
        self.fresh.clear()
        self._tensors.moved(ps, address)
        log.warning("ps %d moved to %s", ps, address)
        return True

    def set_ps_addresses(self, addresses: Sequence[str]) -> None:
        """Follow the coordinator's PS list (a PS joined or left: docs/elastic.md); new variables are placed
        over it (k mod P)."""
        changed = self._net.resize(addresses)
        for ps in changed:
            self._tensors.moved(ps, addresses[ps])
        if changed:
            self.fresh.clear()
            log.info("ps list: %d PS tasks (%s)", len(addresses), ", ".join(addresses))

    def _start(self, ps: int, method: str, request: Any) -> Any:
        return getattr(self.stubs[ps], method).future(request, timeout=self._timeout)

    def _translate(self, ps: int, method: str, exc: Exception) -> PsclusterError:
        if isinstance(exc, grpc.RpcError):
            return rpc.translate(exc, self._net.what(ps, method))
        if isinstance(exc, PsclusterError):
            return exc
        return UnavailableError(f"{self._net.what(ps, method)}: {type(exc).__name__}: {exc}")

    def _gather(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Issue unary calls in parallel (grpc futures); retry the retryable ones synchronously."""
        futs = [self._start(ps, m, req) for ps, m, req in calls]
        out = []
        for (ps, method, req), fut in zip(calls, futs):
            try:
                out.append(fut.result())
            except grpc.RpcError as exc:
                err = rpc.translate(exc, self._net.what(ps, method))
                if not err.retryable:
                    raise err from None
                out.append(self._call(ps, method, req))
        return out

    # -- variables -------------------------------------------------------------------------------
    def discover(self) -> dict[str, Variable]:
        """Every variable on the cluster, from the PS tasks' own listings."""
        infos = self._gather([(ps, "ListShards", pb.ListShardsRequest()) for ps in range(self.num_ps)])
        by_name: dict[str, dict[int, tuple[int, pb.ShardInfo]]] = defaultdict(dict)
        for ps, reply in enumerate(infos):
            for info in reply.shards:
                # with replicas: 2 a shard is listed by its primary and its backup, and may have moved since its
                # creation: the handle names its placement PS once (routes.py finds its primary)
                home = ps_for_ordinal(info.spec.ordinal, self.num_ps)
                if info.spec.shard_index not in by_name[info.spec.variable] or ps == home:
                    by_name[info.spec.variable][info.spec.shard_index] = (home, info)
        found = {}
        optimizers = {}
        for name, shards in by_name.items():
            items = sorted(shards.values(), key=lambda x: x[1].spec.shard_index)
            spec = items[0][1].spec
            optimizers[name] = optimizer_from_pb(spec.optimizer)
            found[name] = Variable(
                name, tuple(spec.full_shape), np.dtype(spec.dtype),
                tuple(ShardPlacement(i.spec.shard_index, ps, i.spec.row_offset,
                                     i.spec.shape[0] if i.spec.shape else 0, i.spec.ordinal)
                      for ps, i in items),
                spec.sparse, spec.table)
        with self._lock:
            self._known = found
            self._optimizers = optimizers
        return dict(found)

    def variables(self) -> dict[str, Variable]:
        """Known variables (discovered once, then kept up to date by create_variable)."""
        with self._lock:
            known = self._known
        return dict(known) if known is not None else self.discover()

    def create_variable(self, name: str, shape: Sequence[int | None] | None = None, dtype: Any = None, *,
                        initial_value: np.ndarray | None = None, initializer: str = "zeros",
                        init_scale: float = 0.0, seed: int = 0, partitioner: Partitioner | None = None,
                        optimizer: OptimizerConfig | None = None, sparse: bool = False,
                        table: TableConfig | None = None) -> Variable:
        """Create a variable (idempotent for an identical definition), placed round-robin by shard ordinal.

        `shape=(None, dim), sparse=True` makes a hash-keyed dynamic table (any int64 key; `table` sets
        its capacity per shard, admission and eviction): one shard per PS task, or the partitioner's
        count over capacity x PS tasks rows.

        Raises:
            AlreadyExistsError: the name exists with another shape, dtype, sharding or optimizer (its kind or
                structure; the hyper-parameters a driver may change may differ): nothing changes.
            InvalidArgumentError: bad shape, dtype, partitioner or optimizer.
        """
        optimizer = (optimizer or OptimizerConfig()).validate()
        table_json = ""
        if shape is not None and len(shape) == 2 and shape[0] is None:
            if not sparse or initial_value is not None:
                raise InvalidArgumentError(f"{name}: shape (None, dim) makes a dynamic table: pass sparse=True and no "
                                           f"initial_value (got sparse={sparse})")
            dt = codec.wire_dtype(np.float32 if dtype is None else dtype)
            table_json = dynamic_config(name, shape, dt, table, initializer, init_scale, seed).to_json()
            full: tuple[int, ...] = (0, int(shape[1] or 0))
        elif initial_value is not None:
            initial_value = np.asarray(initial_value)
            dt = codec.wire_dtype(initial_value.dtype if dtype is None else dtype)
            initial_value = initial_value.astype(dt, copy=False)
            full = tuple(initial_value.shape)
            if shape is not None and tuple(shape) != full:
                raise InvalidArgumentError(f"{name}: shape {tuple(shape)} does not match initial_value {full}")
        else:
            if shape is None or None in shape:
                raise InvalidArgumentError(f"{name}: give a shape (None only as (None, dim) with sparse=True) "
                                           "or an initial_value")
            dt = codec.wire_dtype(np.float32 if dtype is None else dtype)
            full = tuple(int(d) for d in shape if d is not None)
        if table_json:
            cfg = TableConfig.from_json(table_json)
            count = partitioner.count(cfg.capacity * self.num_ps, cfg.dim * dt.itemsize) if partitioner else self.num_ps
            rows = [0] * count
        else:
            rows = split_rows(full, dt, partitioner)
        self.variables()  # discover once
        if self.routes is not None:
            self.routes.refresh()  # which PS tasks a scale drained since this client last looked (rare: a create)
        drained = self.routes.drained if self.routes is not None else frozenset()
        while True:  # reserve the name and its shard ordinals under the lock; the RPCs run outside it
            with self._lock:
                assert self._known is not None
                existing = self._known.get(name)
                if existing is not None:
                    any_count = bool(table_json) and partitioner is None
                    refuse_redefinition(existing, self._optimizers.get(name), full, dt, table_json,
                                        0 if any_count else len(rows), optimizer)
                    return existing
                other = self._creating.get(name)
                if other is None:
                    taken = list(self._known.values()) + [v for v, _ in self._creating.values()]
                    first = sum(v.num_shards for v in taken)
                    placements = []
                    offset = 0
                    for i, n in enumerate(rows):
                        placements.append(ShardPlacement(i, ps_for_new_shard(first + i, self.num_ps, drained), offset, n,
                                                         first + i))
                        offset += n
                    var = Variable(name, full, dt, tuple(placements), sparse, table_json)
                    done = threading.Event()
                    self._creating[name] = (var, done)
                    break
            other[1].wait()  # another thread is creating this name: look again once it has finished
        calls = []
        for pl in placements:
            spec = ShardSpec(name, pl.shard_index, len(rows), full, var.shard_shape(pl), pl.row_offset,
                             dt.str, optimizer, sparse, pl.ordinal, table_json)
            req = pb.CreateShardRequest(
                spec=spec_to_pb(spec), initializer=pb.Initializer(kind=initializer, value=init_scale, seed=seed))
            if initial_value is not None:
                part = initial_value[pl.row_offset:pl.row_offset + pl.rows] if full else initial_value
                req.initial_value.CopyFrom(codec.encode(part))
            calls.append((pl.ps, "CreateShard", req))
        try:
            self._gather(calls)
            with self._lock:
                assert self._known is not None
                self._known[name] = var
                self._optimizers[name] = optimizer
                self._definitions[name] = calls
        finally:
            with self._lock:
                del self._creating[name]
            done.set()
        return var

    # -- pull ------------------------------------------------------------------------------------
    def recreate_missing(self, ps: int, primaries: dict[tuple[str, int], int] | None = None) -> int:
        """Create again on PS `ps` the shards this client defined that it no longer holds and that live there:
        by the replica table `primaries` (shard -> its primary now; replicas: 2 or elastic), else by their
        placement; returns how many."""
        with self._lock:
            calls = [call for calls in self._definitions.values() for call in calls]
        held = {(i.spec.variable, i.spec.shard_index) for i in self._call(ps, "ListShards", pb.ListShardsRequest()).shards}
        missing = missing_here(ps, calls, held, primaries)
        if missing:
            self._gather(missing)
        return len(missing)

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Run fn, retrying UnavailableError/DeadlineExceeded for retry_for seconds (ids make it safe).

        A NotFoundError for a shard of a Variable handle means its PS restarted from a checkpoint older
        than the variable (handles come from create/discover, nothing deletes a variable): retried the
        same way while the coordinator creates it again, then raised as a retryable UnavailableError so
        the closure is rescheduled instead of failing as a user error.
        """
        deadline = time.monotonic() + self.retry_for
        backoff = 0.02
        while True:
            try:
                return fn()
            except PsclusterError as err:
                lost = isinstance(err, NotFoundError)
                if not (err.retryable or lost):
                    raise
                if time.monotonic() + backoff > deadline:
                    if lost:
                        raise UnavailableError(f"a PS lost a shard (restarted without it): {err}") from err
                    raise
                if self._resolver is not None and not lost:
                    for ps in range(self.num_ps):
                        self.relocate(ps)
                # a primary may have moved: the retry goes where the table says, at once if it just moved
                moved = self.routes.refresh() if self.routes is not None and not lost else False
                wait, backoff = retry_wait(backoff, moved, self.routes is not None)
                time.sleep(wait)

    def pull(self, variables: Sequence[Variable]) -> list[np.ndarray]:
        """Current values of variables: one request per PS task, all in parallel, reassembled. In a closure
        of an async job with `push_pull`, the values this worker's last push brought back, if recent
        enough (pscluster/client/fresh.py)."""
        plans.check_variables(variables, "pull")
        scope = context.current_scope()
        if scope is not None and scope.push_pull:
            fresh = self.fresh.take([v.name for v in variables])  # arrays made for these same variables
            if fresh is not None:
                return fresh
        outs = [np.empty(v.shape, v.dtype) for v in variables]
        self.pull_into(list(zip(variables, outs)))
        return outs

    def pull_into(self, dense: Sequence[tuple[Variable, np.ndarray]],
                  rows: Sequence[tuple[Variable, np.ndarray, np.ndarray]] = ()) -> None:
        """Fill arrays in place: whole variables `(var, out)` and table rows `(table, ids, out)`, one request
        per PS task for all of them. The bulk path receives straight into `out` (C-contiguous, the
        variable's dtype); rows of one shard land in place when `ids` is sorted (else one scatter copy).

        Raises:
            InvalidArgumentError: an `out` of the wrong shape, dtype or layout, or ids out of range.
        """
        plan, scatter = plans.pull_plan(dense, rows)
        _token_step(context.current_scope())
        self._pull_plan(plan)
        for out, sel, part in scatter:
            out[sel] = part

    def _pull_plan(self, plan: PullPlan) -> None:
        """Fill each target with its item's tensor, over the bulk path or gRPC."""
        routes = self.routes  # with replicas: each attempt goes where the replica table says now
        self._retrying(lambda: self._tensors.pull(plan if routes is None else routes.route(plan)[0]))

    def pull_rows(self, var: Variable, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `ids` of a table, gathered from the shards that hold them."""
        arr = plans.check_ids(var, ids)
        out = np.empty((arr.size,) + var.shape[1:], var.dtype)
        self.pull_into((), rows=[(var, arr, out)])
        return out

    # -- push ------------------------------------------------------------------------------------
    def push(self, grads: Grads, push_id: str | None = None, step: int = 0,
             rows: Sequence[tuple[Variable, np.ndarray, np.ndarray]] = (), *, nonfinite: str | None = None,
             max_norm: float | None = None, norm_type: float = 2.0, unclipped: int = 0) -> list[int]:
        """Send dense gradients and table row gradients `(table, ids, grads)` under one push id, one
        request per PS task; returns the new version of every shard touched, in request order.

        Every shard of a table gets a part (empty for shards without rows): each shard then counts every
        update of the table, so Adam's bias correction does not depend on how the table is sharded.
        In a closure of an async job with `push_pull`, a dense push also brings back the values
        (pscluster/client/fresh.py).

        Before anything is sent, every gradient is checked for NaN and Inf (pscluster/gradients.py), so
        a bad gradient reaches no PS: nonfinite="reject" (the default; "allow" when the settings'
        nan_policy is allow) raises naming the variables, "skip" pushes nothing and returns [] (in a
        sync step, every shard is told to skip the step, so the step's other replicas are not kept
        waiting), "allow" sends them on. max_norm clips all gradients of the push together to that
        global norm of order norm_type (torch's clip_grad_norm_), except the last `unclipped` of grads.

        Raises:
            NonFiniteGradientError: a gradient holding NaN or Inf under "reject" (nothing was sent).
            InvalidArgumentError: a gradient of the wrong shape, bad ids, a bad policy or max_norm.
        """
        scope = context.current_scope()  # once per push: the id, the step tag, the mark and the record use it
        policy = nonfinite or ("allow" if self.settings.nan_policy == "allow" else "reject")
        try:
            screened = gradients.screen(plans.check_pairs(grads, rows), list(rows), nonfinite=policy,
                                        max_norm=max_norm, norm_type=norm_type, unclipped=unclipped)
        except NonFiniteGradientError:
            self._count_nonfinite("rejected")
            raise
        pid = push_id or (scope.next_push_id() if scope is not None else context.push_id())
        if screened is None:
            self._count_nonfinite("skipped")
            tag = _token_step(scope, step)
            if scope is not None and scope.sync_mode == "sync":
                plan = plans.skip_plan([var for var, _ in grads] + [var for var, _, _ in rows])
                self._push_plan(plan, pid, tag, scope, skip_step=True)
            return []
        grads, rows = screened
        fused = scope is not None and scope.push_pull and not rows
        plan, targets, values = plans.push_plan(grads, rows, fused)
        if rows:  # a table that refuses new keys at capacity: every PS task says they fit before any applies
            routes = self.routes
            self._retrying(lambda: self._gather(plans.room_checks(plan if routes is None else routes.route(plan)[0],
                                                                  rows, pid)))
        versions, replies = self._push_plan(plan, pid, _token_step(scope, step), scope, targets if fused else None)
        if fused and sum(len(r.values) for r in replies) == sum(len(items) for items in plan.values()):
            self.fresh.put(values)  # every PS answered with values (none accumulates, nothing streamed)
        return versions

    def push_rows(self, var: Variable, ids: Sequence[int] | np.ndarray, grads: np.ndarray,
                  push_id: str | None = None, step: int = 0) -> list[int]:
        """Row gradients of a table; only those rows change. Returns the new version of every shard."""
        return self.push((), push_id, step, rows=[(var, np.asarray(ids), grads)])

    def _count_nonfinite(self, action: str) -> None:
        with self._lock:
            self._nonfinite[action] += 1

    def nonfinite_counts(self) -> dict[str, int]:
        """Pushes whose gradient held NaN or Inf, by what was done: {"rejected": n, "skipped": n}."""
        with self._lock:
            return dict(self._nonfinite)

    def _push_plan(self, plan: PushPlan, pid: str, step: int, scope: context.ClosureScope | None,
                   targets: ValueTargets | None = None, skip_step: bool = False
                   ) -> tuple[list[int], list[pb.PushReply]]:
        refs = [item.ref for items in plan.values() for item, _ in items]
        head = pb.PushRequest(push_id=pid, step=step, final_below=scope.final_below if scope is not None else 0,
                              return_values=targets is not None, skip_step=skip_step)
        routes = self.routes

        def attempt() -> list[pb.PushReply]:
            # with replicas, each attempt goes where the replica table says now
            routed, routed_targets = (plan, targets) if routes is None else routes.route(plan, targets)
            return self._tensors.push(routed, head, routed_targets)

        replies = self._retrying(attempt)
        if scope is not None:
            self._record(scope, refs, replies)
        return [v for r in replies for v in r.versions], replies

    @staticmethod
    def _record(scope: context.ClosureScope, refs: Sequence[pb.ShardRef], replies: Sequence[pb.PushReply]) -> None:
        """Note in the running closure's scope which shard versions its pushes produced."""
        pairs = [(v, r.incarnation) for r in replies for v in r.versions]
        for ref, (version, incarnation) in zip(refs, pairs):
            key = (ref.variable, ref.shard_index, incarnation)
            if version > scope.versions.get(key, -1):
                scope.versions[key] = version

    # -- sync replicas ---------------------------------------------------------------------------
    def take_token(self, closure_id: int, worker: str, timeout: float = 30.0,
                   reports: Sequence[tuple[int, int, str]] = ()) -> tuple[int, int]:
        """A sync token from the token queue (PS 0's; with replicas: 2 its primary's; blocks while none is free).
        A retry carries the same closure id, so a token granted before a failover is handed back. `reports`:
        (closure id, step, worker) of earlier closures' step_done, counted first in the same change (one forward
        to the queue's backup instead of one each; a retry counts each once)."""
        request = pb.TokenRequest(closure_id=closure_id, worker=worker, timeout_s=timeout,
                                  reports=[pb.StepDoneRequest(closure_id=c, step=s, worker=w) for c, s, w in reports])
        token = self._retrying(lambda: self._tensors.take_token(request, self.sync_ps()))
        return int(token.step), int(token.replica)

    def step_done(self, closure_id: int, step: int, worker: str) -> tuple[int, int]:
        """Report that a closure finished its pushes for `step` (a retry counts once). Returns the sync state's
        (epoch, version) that counted it: with replicas: 2 the reply does not wait for the state's backup, and the
        closure's reply carries the pair to the coordinator (coordinator/sync_reports.py); (0, 0) with one copy."""
        request = pb.StepDoneRequest(closure_id=closure_id, step=step, worker=worker)
        reply = self._retrying(lambda: self._tensors.step_done(request, self.sync_ps()))
        return int(reply.sync_epoch), int(reply.sync_version)

    def sync_ps(self) -> int:
        """The PS holding the sync token queue and global step now: 0, or with replicas: 2 the primary of its row
        in the newest replica table this client has seen."""
        return self.routes.primary.get(SYNC_STATE_KEY, 0) if self.routes is not None else 0
