"""The PS client (ps-lite's shape): create variables, pull/push them with per-PS fan-out in parallel.

Placement and sharding stay inside the client: callers see whole variables. Small shards of one
request travel in one unary RPC per PS task; shards above `stream_threshold_bytes` are streamed in
`chunk_bytes` chunks. Every push carries an id (exactly-once), so retries after UNAVAILABLE are safe.

    client = PSClient(settings)
    w = client.create_variable("w", initial_value=np.zeros((784, 10), np.float32), optimizer=SGD(0.1))
    client.push([(w, grad)]); value = client.pull([w])[0]
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from pscluster import codec, context, rpc
from pscluster.config import Settings
from pscluster.errors import AlreadyExistsError, InvalidArgumentError, PsclusterError
from pscluster.placement import Partitioner, ps_for_ordinal, split_rows
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.server.convert import spec_to_pb
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.store import ShardSpec
from pscluster.variables import ShardPlacement, Variable

Grads = Sequence[tuple[Variable, np.ndarray]]


def _as_grad(var: Variable, grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(grad)
    if arr.dtype != var.dtype and arr.dtype.kind == var.dtype.kind == "f":
        arr = arr.astype(var.dtype)  # float64 numpy math into a float32 variable is the common case
    if arr.shape != shape:
        raise InvalidArgumentError(f"{var.name}: gradient shape {arr.shape} does not match {shape}")
    return arr


class PSClient:
    """Connections to every PS task, and the variable operations built on them."""

    def __init__(self, settings: Settings, retry_for: float = 5.0) -> None:
        self.settings = settings
        self.retry_for = retry_for
        self._channels = [rpc.open_channel(addr, settings) for addr in settings.cluster.ps]
        self.stubs = [pb_grpc.ParameterServerStub(ch) for ch in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.stubs)), thread_name_prefix="ps-stream")
        self._lock = threading.Lock()
        self._known: dict[str, Variable] | None = None
        self._timeout = settings.rpc_timeout_s

    @property
    def num_ps(self) -> int:
        """Number of PS tasks."""
        return len(self.stubs)

    def close(self) -> None:
        """Close channels and the stream pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, ps: int, method: str, request: Any, retry_for: float | None = None) -> Any:
        return rpc.call(getattr(self.stubs[ps], method), request, timeout=self._timeout,
                        what=f"ps {ps} ({self.settings.cluster.ps[ps]}) {method}",
                        retry_for=self.retry_for if retry_for is None else retry_for)

    def _gather(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Issue unary calls in parallel (grpc futures); retry the retryable ones synchronously."""
        futs = [getattr(self.stubs[ps], m).future(req, timeout=self._timeout) for ps, m, req in calls]
        out = []
        for (ps, method, req), fut in zip(calls, futs):
            try:
                out.append(fut.result())
            except grpc.RpcError as exc:
                err = rpc.translate(exc, f"ps {ps} ({self.settings.cluster.ps[ps]}) {method}")
                if not err.retryable:
                    raise err from exc
                out.append(self._call(ps, method, req))
        return out

    # -- variables -------------------------------------------------------------------------------
    def discover(self) -> dict[str, Variable]:
        """Every variable on the cluster, from the PS tasks' own listings."""
        infos = self._gather([(ps, "ListShards", pb.ListShardsRequest()) for ps in range(self.num_ps)])
        by_name: dict[str, list[tuple[int, pb.ShardInfo]]] = defaultdict(list)
        for ps, reply in enumerate(infos):
            for info in reply.shards:
                by_name[info.spec.variable].append((ps, info))
        found = {}
        for name, items in by_name.items():
            items.sort(key=lambda x: x[1].spec.shard_index)
            spec = items[0][1].spec
            found[name] = Variable(
                name, tuple(spec.full_shape), np.dtype(spec.dtype),
                tuple(ShardPlacement(i.spec.shard_index, ps, i.spec.row_offset,
                                     i.spec.shape[0] if i.spec.shape else 0, i.spec.ordinal)
                      for ps, i in items),
                spec.sparse)
        with self._lock:
            self._known = found
        return dict(found)

    def variables(self) -> dict[str, Variable]:
        """Known variables (discovered once, then kept up to date by create_variable)."""
        with self._lock:
            known = self._known
        return dict(known) if known is not None else self.discover()

    def create_variable(self, name: str, shape: Sequence[int] | None = None, dtype: Any = None, *,
                        initial_value: np.ndarray | None = None, initializer: str = "zeros",
                        init_scale: float = 0.0, seed: int = 0, partitioner: Partitioner | None = None,
                        optimizer: OptimizerConfig | None = None, sparse: bool = False) -> Variable:
        """Create a variable (idempotent for an identical definition), placed round-robin by shard ordinal.

        Raises:
            AlreadyExistsError: the name exists with another shape, dtype or sharding.
            InvalidArgumentError: bad shape, dtype, partitioner or optimizer.
        """
        optimizer = (optimizer or OptimizerConfig()).validate()
        if initial_value is not None:
            initial_value = np.asarray(initial_value)
            dt = codec.wire_dtype(initial_value.dtype if dtype is None else dtype)
            initial_value = initial_value.astype(dt, copy=False)
            full = tuple(initial_value.shape)
            if shape is not None and tuple(shape) != full:
                raise InvalidArgumentError(f"{name}: shape {tuple(shape)} does not match initial_value {full}")
        else:
            if shape is None:
                raise InvalidArgumentError(f"{name}: give a shape or an initial_value")
            dt = codec.wire_dtype(np.float32 if dtype is None else dtype)
            full = tuple(int(d) for d in shape)
        rows = split_rows(full, dt, partitioner)
        known = self.variables()
        with self._lock:
            existing = known.get(name)
            if existing is not None:
                if existing.shape != full or existing.dtype != dt or len(existing.shards) != len(rows):
                    raise AlreadyExistsError(
                        f"variable {name!r} exists as {existing.dtype}{list(existing.shape)} in "
                        f"{existing.num_shards} shard(s); cannot redefine it as {dt}{list(full)} in {len(rows)}")
                return existing
            first = sum(v.num_shards for v in known.values())
            placements = []
            offset = 0
            for i, n in enumerate(rows):
                placements.append(ShardPlacement(i, ps_for_ordinal(first + i, self.num_ps), offset, n, first + i))
                offset += n
            var = Variable(name, full, dt, tuple(placements), sparse)
            calls = []
            for pl in placements:
                spec = ShardSpec(name, pl.shard_index, len(rows), full, var.shard_shape(pl), pl.row_offset,
                                 dt.str, optimizer, sparse, pl.ordinal)
                req = pb.CreateShardRequest(
                    spec=spec_to_pb(spec), initializer=pb.Initializer(kind=initializer, value=init_scale, seed=seed))
                if initial_value is not None:
                    part = initial_value[pl.row_offset:pl.row_offset + pl.rows] if full else initial_value
                    req.initial_value.CopyFrom(codec.encode(part))
                calls.append((pl.ps, "CreateShard", req))
            self._gather(calls)
            assert self._known is not None
            self._known[name] = var
            return var

    # -- pull ------------------------------------------------------------------------------------
    def _streamed(self, var: Variable, pl: ShardPlacement) -> bool:
        return pl.rows * (var.nbytes // max(var.shape[0], 1) if var.shape else var.nbytes) \
            > self.settings.stream_threshold_bytes

    def pull(self, variables: Sequence[Variable]) -> list[np.ndarray]:
        """Current values of variables: one unary RPC per PS task, large shards streamed, in parallel."""
        outs = [np.empty(v.shape, v.dtype) for v in variables]
        by_ps: dict[int, list[tuple[np.ndarray, pb.PullItem]]] = defaultdict(list)
        streams: list[Future[None]] = []
        for var, out in zip(variables, outs):
            for pl in var.shards:
                target = out[pl.row_offset:pl.row_offset + pl.rows] if var.shape else out
                item = pb.PullItem(ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index))
                if self._streamed(var, pl):
                    streams.append(self._pool.submit(self._pull_stream, pl.ps, item, target))
                else:
                    by_ps[pl.ps].append((target, item))
        calls = [(ps, "Pull", pb.PullRequest(items=[i for _, i in items])) for ps, items in by_ps.items()]
        for (ps, _, _), reply in zip(calls, self._gather(calls)):
            for (target, _), tensor in zip(by_ps[ps], reply.tensors):
                target[...] = codec.decode(tensor).reshape(target.shape)
        for fut in streams:
            fut.result()
        return outs

    def _pull_stream(self, ps: int, item: pb.PullItem, target: np.ndarray) -> None:
        flat = target.reshape(-1).view(np.uint8)
        try:
            pos = 0
            for chunk in self.stubs[ps].PullStream(item, timeout=self._timeout):
                if chunk.HasField("header"):
                    continue
                flat[pos:pos + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
                pos += len(chunk.data)
        except grpc.RpcError as exc:
            raise rpc.translate(exc, f"ps {ps} PullStream {item.ref.variable}") from exc
        if pos != flat.size:
            raise PsclusterError(f"ps {ps} PullStream {item.ref.variable}: got {pos} of {flat.size} bytes")

    def pull_rows(self, var: Variable, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `ids` of a table, gathered from the shards that hold them."""
        ids = self._check_ids(var, ids)
        out = np.empty((ids.size,) + var.shape[1:], var.dtype)
        groups = self._group_rows(var, ids)
        calls = [(pl.ps, "Pull", pb.PullRequest(items=[pb.PullItem(
            ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index), ids=codec.encode(ids[sel]))]))
            for pl, sel in groups]
        for (pl, sel), reply in zip(groups, self._gather(calls)):
            out[sel] = codec.decode(reply.tensors[0])
        return out

    # -- push ------------------------------------------------------------------------------------
    def push(self, grads: Grads, push_id: str | None = None, step: int = 0) -> list[int]:
        """Send dense gradients; returns the new version of every shard touched, in order."""
        pid = push_id or context.push_id()
        by_ps: dict[int, list[pb.PushItem]] = defaultdict(list)
        streams: list[Future[pb.PushReply]] = []
        for var, grad in grads:
            arr = _as_grad(var, grad, var.shape)
            for pl in var.shards:
                part = arr[pl.row_offset:pl.row_offset + pl.rows] if var.shape else arr
                ref = pb.ShardRef(variable=var.name, shard_index=pl.shard_index)
                if self._streamed(var, pl):
                    streams.append(self._pool.submit(self._push_stream, pl.ps, pid, step, ref, part))
                else:
                    by_ps[pl.ps].append(pb.PushItem(ref=ref, grad=codec.encode(part)))
        calls = [(ps, "Push", pb.PushRequest(items=items, push_id=pid, step=step)) for ps, items in by_ps.items()]
        replies = self._gather(calls)
        self._record([i.ref for _, _, req in calls for i in req.items], [v for r in replies for v in r.versions])
        versions = [v for reply in replies for v in reply.versions]
        return versions + [v for fut in streams for v in fut.result().versions]

    @staticmethod
    def _record(refs: Sequence[pb.ShardRef], versions: Sequence[int]) -> None:
        scope = context.current_scope()
        if scope is not None:
            for ref, version in zip(refs, versions):
                key = (ref.variable, ref.shard_index)
                if version > scope.versions.get(key, -1):
                    scope.versions[key] = version

    def _push_stream(self, ps: int, pid: str, step: int, ref: pb.ShardRef, grad: np.ndarray) -> pb.PushReply:
        grad = np.ascontiguousarray(grad, dtype=grad.dtype.newbyteorder("<"))
        flat = grad.reshape(-1).view(np.uint8)
        chunk = self.settings.chunk_bytes

        def messages() -> Iterator[pb.PushChunk]:
            item = pb.PushItem(ref=ref, grad=codec.header(grad.dtype, grad.shape))
            yield pb.PushChunk(header=pb.PushRequest(items=[item], push_id=pid, step=step))
            for start in range(0, flat.size, chunk):
                yield pb.PushChunk(data=flat[start:start + chunk].tobytes())

        def once(_request: Any, timeout: float) -> pb.PushReply:
            return self.stubs[ps].PushStream(messages(), timeout=timeout)

        return rpc.call(once, None, timeout=self._timeout, what=f"ps {ps} PushStream {ref.variable}",
                        retry_for=self.retry_for)

    def push_rows(self, var: Variable, ids: Sequence[int] | np.ndarray, grads: np.ndarray,
                  push_id: str | None = None, step: int = 0) -> list[int]:
        """Row gradients of a table; only those rows change. Returns versions of the shards touched."""
        ids = self._check_ids(var, ids)
        arr = _as_grad(var, grads, (ids.size,) + var.shape[1:])
        pid = push_id or context.push_id()
        calls = [(pl.ps, "Push", pb.PushRequest(push_id=pid, step=step, items=[pb.PushItem(
            ref=pb.ShardRef(variable=var.name, shard_index=pl.shard_index),
            grad=codec.encode(arr[sel]), ids=codec.encode(ids[sel]))]))
            for pl, sel in self._group_rows(var, ids)]
        replies = self._gather(calls)
        self._record([req.items[0].ref for _, _, req in calls], [r.versions[0] for r in replies])
        return [v for reply in replies for v in reply.versions]

    @staticmethod
    def _check_ids(var: Variable, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"{var.name}: row ids must be a 1-D integer array, got {arr.dtype}{arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        if not var.shape:
            raise InvalidArgumentError(f"{var.name}: a scalar variable has no rows")
        if arr.size and (arr.min() < 0 or arr.max() >= var.shape[0]):
            bad = arr[(arr < 0) | (arr >= var.shape[0])][0]
            raise InvalidArgumentError(f"{var.name}: row id {bad} outside [0, {var.shape[0]})")
        return arr

    @staticmethod
    def _group_rows(var: Variable, ids: np.ndarray) -> list[tuple[ShardPlacement, np.ndarray]]:
        starts = np.array([pl.row_offset for pl in var.shards])
        which = np.searchsorted(starts, ids, side="right") - 1
        return [(pl, np.flatnonzero(which == k)) for k, pl in enumerate(var.shards) if (which == k).any()]

    # -- cluster-wide operations -----------------------------------------------------------------
    def checkpoint(self, step: int) -> list[str]:
        """Write a checkpoint of every PS task at `step` (call with pushes quiesced for consistency)."""
        replies = self._gather([(ps, "Save", pb.SaveRequest(step=step)) for ps in range(self.num_ps)])
        return [r.path for r in replies]

    def status(self) -> list[pb.PsStatus]:
        """Status of every PS task."""
        return self._gather([(ps, "Status", pb.PsStatusRequest()) for ps in range(self.num_ps)])

    def export(self, path: str) -> dict[str, tuple[int, ...]]:
        """Write every variable, whole, to one safetensors file readable without pscluster."""
        from safetensors.numpy import save_file

        variables = self.discover()
        names = sorted(variables)
        values = self.pull([variables[n] for n in names])
        save_file(dict(zip(names, values)), path, metadata={"format": "pscluster-export"})
        return {n: v.shape for n, v in zip(names, values)}
