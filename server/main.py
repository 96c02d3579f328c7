"""Start a PS daemon: `start(settings)` for tests and launchers, `serve(settings)` for the CLI."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc
from pscluster.server.bulk import BulkHandlers
from pscluster.server.ps import ParameterServerCore
from pscluster.server.servicer import ParameterServerServicer

from pscluster.config import Settings
from pscluster.errors import ConfigError
from pscluster.net import frame_server, rpc, shm, tls
from pscluster.net.frame_server import Listeners
from pscluster.ops import daemon

log = logging.getLogger(__name__)


def start(settings: Settings) -> tuple[Listeners, int, ParameterServerCore]:
    """Build the PS core (restoring if asked), start its gRPC server and bulk port; returns (listeners, port, core)."""
    from pscluster.server import sync_replicas

    core = ParameterServerCore(
        settings.task_index, len(settings.cluster.ps), nan_policy=settings.nan_policy,
        checkpoint_dir=settings.checkpoint_dir, keep_checkpoints=settings.keep_checkpoints,
        dedup_window=settings.dedup_window, max_tensor_bytes=settings.max_tensor_bytes)
    sync = sync_replicas.attach(core)
    if settings.metrics_port is not None:
        # imported only here: prometheus_client (with urllib, http.server) is ~0.1 s of every daemon's
        # start-up, and counters nobody can scrape are not kept (servicer and bulk skip a None)
        from pscluster.ops.metrics import PsMetrics

        core.metrics = PsMetrics(lambda: len(core.store.shards()), core.total_bytes, lambda: core.global_step,
                                 lambda: sync.dropped, core.learning_rates, lambda: sync.skipped,
                                 lambda: core.store.rejected_nonfinite)
    if settings.replica_table:  # replicas: 2, or one copy that can move (elastic)
        from pscluster.server.catch_up import CHUNK_BYTES
        from pscluster.server.link_pool import LinkPool
        from pscluster.server.replica_links import FrameLink, GrpcLink
        from pscluster.server.replication import Replication
        from pscluster.server.replicator import BATCH_BYTES

        link = FrameLink if settings.bulk_transport else GrpcLink
        # a catch-up chunk with room beside it in a frame (max_tensor_bytes) or a gRPC message
        chunk = min(CHUNK_BYTES, settings.max_tensor_bytes // 2, settings.max_message_bytes // 2)
        # a batch of forwards is one frame on the backup: within its payload limit (max_tensor_bytes), with room
        batch = min(BATCH_BYTES, settings.max_tensor_bytes // 2, settings.max_message_bytes // 2)
        core.addresses = list(settings.cluster.ps)  # SetRoles brings the coordinator's list (a PS that joined)
        # links opened now and whenever the list changes, not inside the SetRoles that ends a move's freeze
        pool = core.links = LinkPool(lambda address: link(address, settings))
        pool.prepare(core.addresses, core.own_address())
        core.replication = Replication(core.store, settings.task_index,
                                       lambda ps: pool.take(core.addresses[ps]),
                                       timeout=settings.replication_timeout_s, step_timeout=settings.rpc_timeout_s,
                                       chunk_bytes=chunk, batch_bytes=batch)
        core.replication.sync_state = sync  # the token queue, clocks and G are replicated like a shard
    if settings.restore:
        core.restore()
    bulk = None
    if settings.bulk_transport:
        bulk = BulkHandlers(core).server(settings.bind_host, settings.token_value(),
                                         settings.max_message_bytes, port=settings.framed_port or 0,
                                         **frame_server.limits(settings, tls.BULK_ROLES)).start()
        core.bulk_port = bulk.port
    servicer = ParameterServerServicer(core, settings.chunk_bytes)
    server, port = rpc.create_server(
        settings, lambda s: pb_grpc.add_ParameterServerServicer_to_server(servicer, s),
        name=f"ps{settings.task_index}")
    if core.replication is not None:
        return _ReplicatingListeners(server, bulk, core.replication, core.links), port, core
    return Listeners(server, bulk), port, core


class _ReplicatingListeners(Listeners):
    """replicas: 2: stopping the listeners also stops and joins the replication threads (after the ports close)."""

    def __init__(self, server: Any, frames: Any, replication: Any, links: Any) -> None:
        super().__init__(server, frames)
        self._replication = replication
        self._links = links

    def stop(self, grace: float | None) -> threading.Event:
        """Stop both ports, then the replicators, then close the links none of them took."""
        done = super().stop(grace)
        self._replication.stop()
        self._links.close()
        return done


def join(settings: Settings, retry_for: float = 30.0) -> Settings:
    """A PS the cluster file does not list: ask the coordinator for a task index (JoinPs, docs/elastic.md);
    settings with that index and the coordinator's PS list. It listens on settings.port.

    Raises:
        ConfigError: no --port or no coordinator in the cluster file.
        PsclusterError: the coordinator refused (replicas: 1) or did not answer within retry_for.
    """
    if settings.port is None or not settings.cluster.coordinator:
        raise ConfigError("pscluster ps --join needs --port and a coordinator in the cluster file")
    host = settings.bind_host if settings.bind_host not in ("0.0.0.0", "::", "") else socket.gethostname()
    channel = rpc.open_channel(settings.cluster.coordinator, settings)
    try:
        reply = rpc.call(pb_grpc.CoordinatorStub(channel).JoinPs, pb.JoinPsRequest(address=f"{host}:{settings.port}"),
                         timeout=5.0, retry_for=retry_for, what="coordinator JoinPs")
    finally:
        channel.close()
    log.info("ps %d: joined the PS list (epoch %d): %s", reply.index, reply.ps_epoch, list(reply.ps_addresses))
    cluster = settings.cluster.model_copy(update={"ps": list(reply.ps_addresses)})
    return settings.model_copy(update={"task_index": reply.index, "cluster": cluster})


def serve(settings: Settings) -> None:
    """Run a PS daemon until SIGTERM/SIGINT."""
    stop = daemon.stop_on_signals(settings.parent_pid)
    shm.sweep()  # segments a killed process left behind (pscluster/net/shm.py)
    server, port, core = start(settings)
    try:
        metrics = ""
        if settings.metrics_port is not None:
            from pscluster.ops.metrics import serve as metrics_serve

            metrics = f" metrics={metrics_serve(core.metrics.registry, settings.metrics_host, settings.metrics_port)}"
        print(f"READY ps {settings.task_index} {settings.bind_host}:{port} restored_step={core.restored_step}"
              f"{metrics}", flush=True)
        stop.wait()
        log.info("ps %d: stopping", settings.task_index)
    finally:
        server.stop(grace=1.0).wait()
