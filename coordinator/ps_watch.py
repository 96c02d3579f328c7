"""The coordinator's watch over its PS tasks, built and wired in one place: the replica keeper (replicas: 2 or
elastic: shard -> primary, backup, epoch; coordinator/replica_keeper.py), the elastic executor over it, and the
PS monitor (coordinator/ps_monitor.py), which the keeper tells of the shards it restored from a checkpoint and
asks where each shard lives now."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pscluster.coordinator.elastic import Elastic
from pscluster.coordinator.ps_book import PsBook
from pscluster.coordinator.ps_monitor import PsMonitor
from pscluster.coordinator.replica_keeper import ReplicaKeeper
from pscluster.coordinator.sync_reports import ReportResender
from pscluster.proto import pscluster_pb2_grpc as pb_grpc

from pscluster.client.client import PSClient
from pscluster.config import Settings
from pscluster.net import rpc


@dataclass(frozen=True)
class PsWatch:
    """The started parts; keeper, elastic and reports are None with replicas: 1 and no elastic."""

    keeper: ReplicaKeeper | None
    elastic: Elastic | None
    monitor: PsMonitor
    reports: ReportResender | None = None  # sync reports a new primary of the sync state may lack

    def stop(self) -> None:
        """Stop and join every started part."""
        self.monitor.stop()
        if self.keeper is not None:
            self.keeper.stop()
        if self.reports is not None:
            self.reports.stop()


def start_ps_watch(settings: Settings, client: PSClient, on_down: Callable[[], None], on_up: Callable[[], None],
                   on_fatal: Callable[[BaseException], None]) -> PsWatch:
    """Start the keeper (when settings ask for a replica table) and the monitor; the coordinator stops them."""
    keeper: ReplicaKeeper | None = None
    monitor = PsMonitor(client, on_down=on_down, on_up=on_up, on_fatal=on_fatal, replicated=settings.replica_table,
                        table=(lambda: keeper.table() if keeper is not None else {}) if settings.replica_table else None)
    reports = ReportResender(client.step_done) if settings.replica_table else None
    keeper = ReplicaKeeper(
        list(client.stubs), book=PsBook.from_file(settings.cluster.ps), on_book=client.set_ps_addresses,
        connect=lambda address: pb_grpc.ParameterServerStub(rpc.open_channel(address, settings)),
        copies=settings.replicas, on_restored=monitor.shard_restored,
        on_sync_row=reports.observe if reports is not None else None,
    ).start() if settings.replica_table else None
    if reports is not None:
        reports.start()  # after the keeper was built: nothing to stop if that failed
    monitor.start()
    return PsWatch(keeper, Elastic(keeper, keeper.stubs) if keeper is not None else None, monitor, reports)
