"""Run pscluster on Ray: PS tasks and workers as Ray actors serving the same gRPC daemons.

    import ray
    ray.init(address="auto")                        # or a local runtime
    cluster = RayCluster(num_ps=2, num_workers=4, checkpoint_dir="/shared/ckpt").start()
    coord = ClusterCoordinator(cluster.settings())  # the coordinator lives in the driver
    ...
    cluster.stop()

PS actors are spread over nodes by a placement group (STRICT_SPREAD when the cluster has enough
nodes, SPREAD otherwise) and restarted by Ray (`max_restarts=-1`); a restarted PS restores its newest
checkpoint, so `checkpoint_dir` must be visible to every node that may host it. A PS listens on its
node's address (any free port unless `base_port` fixes one) and records it in a named directory actor
each time it starts; every client of the cluster (the driver's coordinator, the worker actors) asks
the directory where PS i is when it stops answering, so a PS that Ray restarts on another node, with
another address, is found without restarting the job. Workers are restarted too and simply register
again. The cluster spec travels to the actors by value (no shared file system needed). Needs the
`ray` extra.
"""

from __future__ import annotations

import pathlib
import tempfile
import threading
import uuid
from typing import Any

import yaml

from pscluster.config import Settings, load_settings
from pscluster.ops.launcher import free_port


class _Directory:
    """The body of the named directory actor: where each PS listens now, and on which Ray node."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[str, str]] = {}  # PS index -> (address, Ray node id)

    def set(self, index: int, address: str, node: str = "") -> None:
        """PS index (re)started at address, on Ray node `node`."""
        self._where[index] = (address, node)

    def get(self, index: int) -> str:
        """Where PS index listens ('' if it never registered)."""
        return self._where.get(index, ("", ""))[0]

    def locations(self) -> dict[int, tuple[str, str]]:
        """{PS index: (address, Ray node id)} of every PS that registered."""
        return dict(self._where)


class DirectoryResolver:
    """A picklable PSClient resolver that asks the named directory actor (inside or outside Ray actors)."""

    def __init__(self, name: str, namespace: str | None) -> None:
        self.name = name
        self.namespace = namespace

    def __call__(self, index: int) -> str:
        import ray

        directory = ray.get_actor(self.name, namespace=self.namespace)
        return str(ray.get(directory.get.remote(index), timeout=10))


class _DaemonActor:
    """The body of a Ray actor: starts one pscluster daemon in the actor's process."""

    def __init__(self, role: str, config: dict[str, Any], index: int, port: int, env: dict[str, str],
                 resolver: DirectoryResolver) -> None:
        import os

        import ray

        os.environ.update(env)
        overrides: dict[str, Any] = {**config, "task_type": role, "task_index": index, "port": port}
        node = ray.util.get_node_ip_address()
        if role == "ps":
            overrides.update(restore=True, checkpoint_dir=env["PSCLUSTER_CHECKPOINT_DIR"])
        overrides.setdefault("advertise_host", node if config.get("bind_host") in ("0.0.0.0", "::") else None)
        self.settings = load_settings(None, env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
                                      overrides=overrides)
        self.role = role
        if role == "ps":
            from pscluster.server.main import start

            self.server, self.port, _ = start(self.settings)
            host = self.settings.advertise_host or self.settings.bind_host
            directory = ray.get_actor(resolver.name, namespace=resolver.namespace)
            node_id = str(ray.get_runtime_context().get_node_id())
            ray.get(directory.set.remote(index, f"{host}:{self.port}", node_id), timeout=30)  # before anyone asks
        else:
            from pscluster.worker.main import Heartbeater
            from pscluster.worker.main import start as start_worker

            self.server, self.port, servicer = start_worker(self.settings, ps_resolver=resolver)
            address = f"{self.settings.advertise_host or self.settings.bind_host}:{self.port}"
            self.heart = Heartbeater(self.settings, servicer.worker_id, address, servicer.runner.datasets,
                                     servicer.closure_port)
            self.heart.start()

    def address(self) -> str:
        """host:port others reach the daemon at."""
        return f"{self.settings.advertise_host or self.settings.bind_host}:{self.port}"

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

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
        self.host = host
        self.ps_ports = [base_port + i if base_port else 0 for i in range(num_ps)]
        self.coordinator_address = f"{host}:{coordinator_port or free_port(host)}"
        self.spec: dict[str, Any] = {}
        self.cluster_file = pathlib.Path(self._tmp.name, "cluster.yaml")
        self.token = token
        self.num_workers = num_workers
        self.ps: list[Any] = []
        self.workers: list[Any] = []
        self._next_worker = 0  # task index of the next worker actor
        self._lock = threading.Lock()
        self._placement: Any = None
        self._directory: Any = None
        self.resolver = DirectoryResolver(f"pscluster-ps-directory-{uuid.uuid4().hex[:12]}",
                                          ray.get_runtime_context().namespace)

    def settings(self, **overrides: Any) -> Settings:
        """Settings for the driver's ClusterCoordinator (pass `ps_resolver=cluster.resolver` to it too)."""
        if not self.spec:
            raise RuntimeError("RayCluster.start() first: the PS addresses are known once the PS actors run")
        env = {"PSCLUSTER_TOKEN": self.token} if self.token else {}
        return load_settings(self.cluster_file, env=env, overrides=overrides)

    def _env(self) -> dict[str, str]:
        env = {"PSCLUSTER_CHECKPOINT_DIR": self.checkpoint_dir, "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1"}
        if self.token:
            env["PSCLUSTER_TOKEN"] = self.token
        return env

    def _config(self) -> dict[str, Any]:
        # before the PS actors run, their addresses are unknown: a PS binds its own port (base_port + i, or
        # any free one), so the spec it is started with only needs the right number of entries
        spec = self.spec or {"ps": [f"{self.host}:{i + 1}" for i in range(len(self.ps_ports))],
                             "coordinator": self.coordinator_address}
        return {"cluster": spec, "bind_host": self.host}

    def start(self, timeout: float = 120.0) -> RayCluster:
        """Start the directory, the PS actors, then the workers; wait until each daemon serves."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        # The directory lives on the driver's node: the coordinator runs there, so a job that lost that
        # node is over anyway, while a directory on another node would take every PS address with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._directory = ray.remote(num_cpus=0)(_Directory).options(
            name=self.resolver.name, namespace=self.resolver.namespace, scheduling_strategy=here).remote()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        strategy = "STRICT_SPREAD" if len(nodes) >= len(self.ps_ports) else "SPREAD"
        self._placement = placement_group([{"CPU": 0.01}] * len(self.ps_ports), strategy=strategy)
        ray.get(self._placement.ready(), timeout=timeout)
        ps_cls = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0.01)(_DaemonActor)
        for i, port in enumerate(self.ps_ports):
            self.ps.append(ps_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement, placement_group_bundle_index=i)).remote(
                    "ps", self._config(), i, port, self._env(), self.resolver))
        addresses = ray.get([a.address.remote() for a in self.ps], timeout=timeout)
        self.spec = {"ps": list(addresses), "coordinator": self.coordinator_address}
        self.cluster_file.write_text(yaml.safe_dump(self._config()))
        for _ in range(self.num_workers):
            self.add_worker()
        ray.get([a.address.remote() for a in self.workers], timeout=timeout)
        return self

    def ps_locations(self, timeout: float = 30.0) -> dict[int, tuple[str, str]]:
        """{PS index: (address, Ray node id)} as each PS last registered them, from the directory actor."""
        import ray

        if self._directory is None:
            raise RuntimeError("RayCluster.start() first")
        return dict(ray.get(self._directory.locations.remote(), timeout=timeout))

    def add_worker(self) -> Any:
        """Start one more worker actor (it registers with the coordinator on its own)."""
        import ray

        worker_cls = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0.01)(_DaemonActor)
        with self._lock:
            index = self._next_worker
            self._next_worker += 1
        # Submitting an actor talks to Ray's control plane: done outside the lock.
        actor = worker_cls.remote("worker", self._config(), index, 0, self._env(), self.resolver)
        with self._lock:
            self.workers.append(actor)
        return actor

    def stop(self) -> None:
        """Kill every actor (no restart) and drop the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.workers + self.ps + ([self._directory] if self._directory is not None else []):
            ray.kill(actor, no_restart=True)
        if self._placement is not None:
            remove_placement_group(self._placement)
        self._tmp.cleanup()
