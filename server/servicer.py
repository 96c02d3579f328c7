"""The ParameterServer gRPC servicer: decode, call ParameterServerCore, encode. Nothing else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem
from pscluster.server.table_ops import table_counts

from pscluster import codec
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.specs import spec_from_pb, spec_to_pb


def _key(ref: pb.ShardRef) -> tuple[str, int]:
    return (ref.variable, ref.shard_index)


def _ids(msg: pb.Tensor, present: bool) -> np.ndarray | None:
    return codec.decode_ids(msg) if present else None


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thin translation layer over a ParameterServerCore."""

    def __init__(self, core: ParameterServerCore, chunk_bytes: int) -> None:
        self.core = core
        self.chunk_bytes = chunk_bytes

    def CreateShard(self, request: pb.CreateShardRequest, context: grpc.ServicerContext) -> pb.ShardInfo:
        spec = spec_from_pb(request.spec)
        initial = codec.decode(request.initial_value, spec.variable) if request.HasField("initial_value") else None
        init = request.initializer
        shard = self.core.create(spec, initial, init.kind, init.value, init.seed)
        return pb.ShardInfo(spec=spec_to_pb(shard.spec), version=shard.version, ps_index=self.core.ps_index)

    def ListShards(self, request: pb.ListShardsRequest, context: grpc.ServicerContext) -> pb.ListShardsReply:
        return pb.ListShardsReply(shards=[
            pb.ShardInfo(spec=spec_to_pb(s.spec), version=s.version, ps_index=self.core.ps_index,
                         restored_version=s.restored_version, **table_counts(s))
            for s in self.core.store.shards()])

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullReply:
        started = time.perf_counter()
        out = self.core.pull([(_key(i.ref), _ids(i.ids, i.HasField("ids"))) for i in request.items])
        self._observe("pull", sum(a.nbytes for a, _ in out), started)
        return pb.PullReply(tensors=[codec.encode(a) for a, _ in out], versions=[v for _, v in out])

    def _observe(self, op: str, nbytes: int, started: float) -> None:
        if self.core.metrics is not None:
            self.core.metrics.observe(op, "grpc", nbytes, started)

    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        started = time.perf_counter()
        items = [PushItem(_key(i.ref), codec.decode(i.grad, i.ref.variable), _ids(i.ids, i.HasField("ids")))
                 for i in request.items]
        results = self.core.push(request.push_id, request.step, items, request.final_below,
                                 skip_step=request.skip_step)
        self._observe("push", sum(i.grad.nbytes for i in items), started)
        values = []
        if request.return_values and self.core.returns_values(request.items):  # fused push-pull
            values = [codec.encode(a) for a, _ in self.core.pull([(i.key, None) for i in items])]
        return pb.PushReply(versions=[r.version for r in results], applied=[r.applied for r in results],
                            incarnation=self.core.incarnation, values=values)

    def PullStream(self, request: pb.PullItem, context: grpc.ServicerContext) -> Iterator[pb.PullChunk]:
        spec, version, chunks = self.core.pull_stream(_key(request.ref), self.chunk_bytes)
        yield pb.PullChunk(header=codec.header(np.dtype(spec.dtype), spec.shape), version=version)
        for chunk in chunks:
            yield pb.PullChunk(data=chunk)

    def PushStream(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> pb.PushReply:
        first = next(request_iterator, None)
        if first is None or len(first.header.items) != 1:
            raise InvalidArgumentError("PushStream: the first message must carry a header with exactly one item")
        req = first.header
        item = req.items[0]
        dtype = codec.wire_dtype(item.grad.dtype)
        ids = _ids(item.ids, item.HasField("ids"))
        chunks = (m.data for m in request_iterator)
        result = self.core.push_stream(req.push_id, req.step, _key(item.ref), dtype, tuple(item.grad.shape), ids,
                                       _prepend(first.data, chunks), req.final_below)
        return pb.PushReply(versions=[result.version], applied=[result.applied], incarnation=self.core.incarnation)

    def Save(self, request: pb.SaveRequest, context: grpc.ServicerContext) -> pb.SaveReply:
        path, saved = self.core.save(request.step, request.absent)
        return pb.SaveReply(path=str(path), saved=[pb.ShardRef(variable=v, shard_index=i) for v, i in saved])

    def ConfigureSync(self, request: pb.SyncConfigRequest, context: grpc.ServicerContext) -> pb.SyncConfigReply:
        step = self.core.replicas().configure(request.mode or "async", request.replicas_to_aggregate,
                                              request.total_num_replicas, request.staleness)
        return pb.SyncConfigReply(global_step=step)

    def TakeToken(self, request: pb.TokenRequest, context: grpc.ServicerContext) -> pb.TokenReply:
        step, replica = self.core.replicas().take_token(request.closure_id, request.worker, request.timeout_s or 30.0,
                                                        [(r.closure_id, r.step, r.worker) for r in request.reports])
        return pb.TokenReply(step=step, replica=replica)

    def StepDone(self, request: pb.StepDoneRequest, context: grpc.ServicerContext) -> pb.StepReply:
        epoch, version = self.core.replicas().step_done(request.closure_id, request.step, request.worker)
        reply = self.GetStep(pb.StepRequest(), context)
        reply.sync_epoch, reply.sync_version = epoch, version
        return reply

    def GetStep(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepReply:
        sync = self.core.replicas()
        return pb.StepReply(global_step=self.core.global_step, dropped_stale=sync.dropped, mode=sync.mode,
                            max_spread=sync.max_spread, clocks=dict(sync.clocks),
                            replicas_to_aggregate=sync.replicas_to_aggregate)

    def Replicate(self, request: pb.ReplicateRequest, context: grpc.ServicerContext) -> pb.ReplicateReply:
        return self._replication("Replicate").receive(request)

    def SetRoles(self, request: pb.SetRolesRequest, context: grpc.ServicerContext) -> pb.SetRolesReply:
        self._replication("SetRoles")
        self.core.take_roles(request.version, [Role(_key(r.ref), r.epoch, r.primary, r.backup) for r in request.roles],
                             request.ps_addresses, request.ps_epoch, request.drained)
        return pb.SetRolesReply()

    def GetRoles(self, request: pb.GetRolesRequest, context: grpc.ServicerContext) -> pb.SetRolesRequest:
        version, roles = self._replication("GetRoles").roles()
        return pb.SetRolesRequest(version=version, ps_addresses=self.core.addresses, ps_epoch=self.core.ps_epoch,
                                  drained=self.core.drained(), roles=[
            pb.ShardRole(ref=pb.ShardRef(variable=r.key[0], shard_index=r.key[1]), epoch=r.epoch, primary=r.primary,
                         backup=r.backup) for r in roles])

    def FreezeShard(self, request: pb.FreezeRequest, context: grpc.ServicerContext) -> pb.FreezeReply:
        if request.thaw:
            return pb.FreezeReply(dropped=self.core.thaw_shard(_key(request.ref), request.drop))
        return pb.FreezeReply(version=self.core.freeze_shard(_key(request.ref), request.successor, request.lease_s))

    def _replication(self, method: str) -> Replication:
        if self.core.replication is None:
            raise FailedPreconditionError(f"{method}: ps {self.core.ps_index} runs with replicas: 1; "
                                          "start the cluster with replicas: 2")
        replication: Replication = self.core.replication
        return replication

    def SetHyperparameters(self, request: pb.HyperparametersRequest,
                           context: grpc.ServicerContext) -> pb.HyperparametersReply:
        shards, names = self.core.set_hyperparameters(list(request.variables), request.changes_json, request.dry_run)
        return pb.HyperparametersReply(shards=shards, variables=names)

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictReply:
        return pb.EvictReply(evicted=self.core.evict(request.variable))

    def EvictedKeys(self, request: pb.EvictedKeysRequest, context: grpc.ServicerContext) -> pb.EvictedKeysReply:
        keys, overflowed = self.core.evicted_keys(request.variable)
        return pb.EvictedKeysReply(keys=codec.encode(keys), overflowed=overflowed)

    def ReadTable(self, request: pb.ReadTableRequest, context: grpc.ServicerContext) -> pb.ReadTableReply:
        keys, values, after, version = self.core.read_table(_key(request.ref), request.start, request.max_rows,
                                                            request.float16)
        return pb.ReadTableReply(keys=codec.encode(keys), values=codec.encode(values), next=after, version=version)

    def CheckRoom(self, request: pb.RoomRequest, context: grpc.ServicerContext) -> pb.RoomReply:
        self.core.check_room(request.push_id, [(_key(i.ref), codec.decode_ids(i.ids)) for i in request.items])
        return pb.RoomReply()

    def Status(self, request: pb.PsStatusRequest, context: grpc.ServicerContext) -> pb.PsStatus:
        core = self.core
        sync_version = core.replicas().current_version()
        return pb.PsStatus(ps_index=core.ps_index, num_ps=core.num_ps, global_step=core.global_step,
                           restored_step=core.restored_step, num_shards=len(core.store.shards()),
                           total_bytes=core.total_bytes(),
                           dropped_stale=core.replicas().dropped,
                           incarnation=core.incarnation, bulk_port=core.bulk_port,
                           sync_version=sync_version, **_replica_status(core.replication, sync_version))


def _replica_status(replication: Replication | None, sync_version: int) -> dict[str, Any]:
    if replication is None:
        return {}
    epoch, confirmed = replication.sync_confirmed(sync_version)
    return {"roles_version": replication.version,
            "catching_up": [pb.ShardRef(variable=v, shard_index=i) for v, i in replication.catching_up()],
            "sync_confirmed_epoch": epoch, "sync_confirmed_version": confirmed}


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest
