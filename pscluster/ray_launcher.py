"""Run pscluster on Ray: PS tasks and workers as Ray actors serving the same gRPC daemons.

    import ray
    ray.init(address="auto")                        # or a local runtime
    cluster = RayCluster(num_ps=2, num_workers=4, checkpoint_dir="/shared/ckpt").start()
    coord = ClusterCoordinator(cluster.settings())  # the coordinator lives in the driver
    ...
    cluster.stop()

PS actors are spread over nodes by a placement group (STRICT_SPREAD when the cluster has enough
nodes, SPREAD otherwise) and restarted by Ray (`max_restarts=-1`); a restarted PS restores its newest
checkpoint, so `checkpoint_dir` must be visible to every node that may host it. PS i listens on
`base_port + i` of its node so that clients find it again after a restart. Workers are restarted
too and simply register again. Needs the `ray` extra.
"""

from __future__ import annotations

import pathlib
import tempfile
import threading
from typing import Any

import yaml

from pscluster.config import Settings, load_settings
from pscluster.launcher import free_port


class _DaemonActor:
    """The body of a Ray actor: starts one pscluster daemon in the actor's process."""

    def __init__(self, role: str, cluster_file: str, index: int, port: int, env: dict[str, str]) -> None:
        import os

        os.environ.update(env)
        overrides: dict[str, Any] = {"task_type": role, "task_index": index, "port": port}
        if role == "ps":
            overrides.update(restore=True, checkpoint_dir=env["PSCLUSTER_CHECKPOINT_DIR"])
        self.settings = load_settings(cluster_file, overrides=overrides)
        self.role = role
        if role == "ps":
            from pscluster.server.main import start

            self.server, self.port, _ = start(self.settings)
        else:
            from pscluster.worker.main import Heartbeater
            from pscluster.worker.main import start as start_worker

            self.server, self.port, servicer = start_worker(self.settings)
            address = f"{self.settings.advertise_host or self.settings.bind_host}:{self.port}"
            self.heart = Heartbeater(self.settings, servicer.worker_id, address, servicer.runner.datasets,
                                     servicer.closure_port)
            self.heart.start()

    def address(self) -> str:
        """host:port of the daemon."""
        return f"{self.settings.bind_host}:{self.port}"

    def pid(self) -> int:
        """The actor's process id."""
        import os

        return os.getpid()


class RayCluster:
    """P PS actors and W worker actors on the Ray cluster `ray.init` connected to."""

    def __init__(self, num_ps: int = 2, num_workers: int = 2, *, checkpoint_dir: str | None = None,
                 host: str = "127.0.0.1", base_port: int | None = None, coordinator_port: int | None = None,
                 token: str | None = None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("call ray.init(...) before RayCluster(...)")
        self._tmp = tempfile.TemporaryDirectory(prefix="pscluster-ray-")
        self.checkpoint_dir = checkpoint_dir or str(pathlib.Path(self._tmp.name, "checkpoints"))
        base = base_port or free_port(host)
        self.ps_ports = [base + i for i in range(num_ps)] if base_port else [free_port(host) for _ in range(num_ps)]
        self.spec = {"ps": [f"{host}:{p}" for p in self.ps_ports],
                     "coordinator": f"{host}:{coordinator_port or free_port(host)}"}
        self.cluster_file = pathlib.Path(self._tmp.name, "cluster.yaml")
        self.cluster_file.write_text(yaml.safe_dump({"cluster": self.spec, "bind_host": host}))
        self.token = token
        self.num_workers = num_workers
        self.ps: list[Any] = []
        self.workers: list[Any] = []
        self._next_worker = 0  # task index of the next worker actor
        self._lock = threading.Lock()
        self._placement: Any = None

    def settings(self, **overrides: Any) -> Settings:
        """Settings for the driver's ClusterCoordinator."""
        env = {"PSCLUSTER_TOKEN": self.token} if self.token else {}
        return load_settings(self.cluster_file, env=env, overrides=overrides)

    def _env(self) -> dict[str, str]:
        env = {"PSCLUSTER_CHECKPOINT_DIR": self.checkpoint_dir, "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1"}
        if self.token:
            env["PSCLUSTER_TOKEN"] = self.token
        return env

    def start(self, timeout: float = 120.0) -> RayCluster:
        """Start every actor and wait until each daemon serves."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        strategy = "STRICT_SPREAD" if len(nodes) >= len(self.ps_ports) else "SPREAD"
        self._placement = placement_group([{"CPU": 0.01}] * len(self.ps_ports), strategy=strategy)
        ray.get(self._placement.ready(), timeout=timeout)
        ps_cls = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0.01)(_DaemonActor)
        for i, port in enumerate(self.ps_ports):
            self.ps.append(ps_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement, placement_group_bundle_index=i)).remote(
                    "ps", str(self.cluster_file), i, port, self._env()))
        ray.get([a.address.remote() for a in self.ps], timeout=timeout)
        for _ in range(self.num_workers):
            self.add_worker()
        ray.get([a.address.remote() for a in self.workers], timeout=timeout)
        return self

    def add_worker(self) -> Any:
        """Start one more worker actor (it registers with the coordinator on its own)."""
        import ray

        worker_cls = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0.01)(_DaemonActor)
        with self._lock:
            index = self._next_worker
            self._next_worker += 1
        # Submitting an actor talks to Ray's control plane: done outside the lock.
        actor = worker_cls.remote("worker", str(self.cluster_file), index, 0, self._env())
        with self._lock:
            self.workers.append(actor)
        return actor

    def stop(self) -> None:
        """Kill every actor (no restart) and drop the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.workers + self.ps:
            ray.kill(actor, no_restart=True)
        if self._placement is not None:
            remove_placement_group(self._placement)
        self._tmp.cleanup()
