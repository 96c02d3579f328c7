"""Sync replicas (placeholder attach point; filled in by the sync-replicas work)."""

from __future__ import annotations

from pscluster.server.ps import ParameterServerCore


def attach(core: ParameterServerCore) -> None:
    """Install sync-replica state on a PS core (async only for now)."""
    core.sync = None
