"""B15FLOOR: what the second copy must cost at least, in CPU per W2 step, without a cluster around it.

One process, two PS cores: a primary holding W2's variables (784x128, 128, 128x10, 10; SGD) and a backup behind
a real bulk port on 127.0.0.1, reached by the primary's real FrameLink. The main thread pushes one W2 step's
gradients at a time (a push waits for its backup, as a worker's does) and the process's CPU per push is read
from /proc (every thread: the push, the replicator, the backup's connection). Three variants, alternating:

- `one`: replicas: 1 (the push alone);
- `ack`: replicas: 2, but the backup answers each forward APPLIED without applying it (a bench-only patch of
  this process's backup core): the copy's transport alone (the forward's copy and message, the send, the
  backup's receive and parse, the reply);
- `apply`: replicas: 2 as shipped.

- `split` (after the three): `apply - one` of W2's shards in the two halves 2 PS hold (HALVES), a primary
  each: a step's copy as a 2-PS cluster makes it (two batches, so the batch's fixed cost twice).

`ack - one` is the transport's floor and `apply - ack` the backup's apply; in a cluster each PS pays its own
shards' forwarding and another PS's apply, so per W2 step (one push per PS) the copy costs all processes at
least `apply - one`. On 2 cores, where W2's steps/s is ~2 cores / all processes' CPU per step, that predicts
the least throughput cost: 1 - T1 / (T1 + floor), T1 = all processes' CPU per step with one copy (B15COST).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import sync_replicas
from pscluster.server.bulk import BulkHandlers
from pscluster.server.optimizers import OptimizerConfig
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replica_links import FrameLink
from pscluster.server.replication import Replication, Role
from pscluster.server.store import PushItem, ShardSpec

from pscluster.config import ClusterSpec, Settings

SHAPES = {"w1": (784, 128), "b1": (128,), "w2": (128, 10), "b2": (10,)}  # W2's MLP (examples/mnist.py)
# W2 on 2 PS (w1 in 2 shards, the rest whole): each PS forwards its own shards, so a step makes two batches
HALVES = ({"w1": (392, 128), "b1": (128,)}, {"w1": (392, 128), "w2": (128, 10), "b2": (10,)})


def _acks_only(request: pb.ReplicateRequest, arrays: Any = None, owned: bool = False) -> pb.ReplicateReply:
    """A backup that confirms every forward without applying it (the `ack` variant)."""
    return pb.ReplicateReply(outcomes=[pb.REPLICA_APPLIED] * len(request.forwards),
                             versions=[f.version for f in request.forwards])


def _dense_acks_only(forwards: Any, grads: Any) -> tuple[list[int], list[int]]:
    """As `_acks_only`, for a batch in the compact form (server/replica_wire.py)."""
    return [pb.REPLICA_APPLIED] * len(forwards), [f.version for f in forwards]


def _variant(kind: str, pushes: int, shapes: dict[str, tuple[int, ...]] | None = None) -> float:
    """CPU ms per push of one variant, on fresh cores (W2's variables, or `shapes`)."""
    shapes = SHAPES if shapes is None else shapes
    backup = ParameterServerCore(1, 2)
    sync_replicas.attach(backup)
    backup.replication = Replication(backup.store, 1, lambda ps: FrameLink("127.0.0.1:1", Settings()))
    if kind == "ack":
        backup.replication.receive = _acks_only  # type: ignore[method-assign]
        backup.replication.receive_dense = _dense_acks_only  # type: ignore[method-assign]
    frames = BulkHandlers(backup).server("127.0.0.1", None, 1 << 20).start()
    settings = Settings(cluster=ClusterSpec(ps=["127.0.0.1:1", "127.0.0.1:2"]))
    primary = ParameterServerCore(0, 2)
    sync_replicas.attach(primary)
    try:
        for name, shape in shapes.items():
            spec = ShardSpec(name, 0, 1, shape, shape, 0, "<f4", OptimizerConfig("sgd", 0.1))
            primary.create(spec, np.zeros(shape, np.float32), "zeros", 0, 0)
        if kind != "one":
            primary.replication = Replication(
                primary.store, 0, lambda ps: FrameLink(settings.cluster.ps[ps], settings,
                                                       port_of=lambda timeout: frames.port), timeout=10.0)
            roles = [Role((name, 0), 1, 0, 1) for name in shapes]
            backup.replication.set_roles(1, roles)
            primary.replication.set_roles(1, roles)
            primary.replication.wait([((name, 0), 0) for name in shapes])
        grads = {name: np.full(shape, 1e-3, np.float32) for name, shape in shapes.items()}
        for i in range(50):  # warm-up: connections, buffers
            primary.push(f"warm{i}", 0, [PushItem((name, 0), g) for name, g in grads.items()])
        cpu = time.process_time()
        for i in range(pushes):
            primary.push(f"p{i}", 0, [PushItem((name, 0), g) for name, g in grads.items()])
        return 1000.0 * (time.process_time() - cpu) / pushes
    finally:
        if primary.replication is not None:
            primary.replication.stop()
        backup.replication.stop()
        frames.stop()


def floor(runs: int = 3, pushes: int = 2000) -> dict[str, Any]:
    """Medians over `runs` rounds of the variants (alternating): CPU ms per W2 push (`split`: per W2 step), all
    threads."""
    load = os.getloadavg()[0]
    rounds = [{kind: _variant(kind, pushes) for kind in ("one", "ack", "apply")} |
              {"split": sum(_variant("apply", pushes, h) - _variant("one", pushes, h) for h in HALVES)}
              for _ in range(runs)]
    med = {kind: statistics.median(r[kind] for r in rounds) for kind in ("one", "ack", "apply", "split")}
    return {**med, "transport_ms": med["ack"] - med["one"], "apply_ms": med["apply"] - med["ack"],
            "copy_ms": med["apply"] - med["one"], "split_ms": med["split"], "rounds": rounds, "pushes": pushes,
            "load_before": load, "load_after": os.getloadavg()[0]}
