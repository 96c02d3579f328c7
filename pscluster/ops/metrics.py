"""Prometheus metrics of every daemon (prometheus-client), each in its own registry.

PS: requests, bytes and latency by op and transport; shards, bytes held, global step, stale drops.
Worker: closures by outcome, closure latency. Coordinator (collected at scrape time from its state):
closures queued/running/done/retried/failed, workers alive, per-worker step rate, lost updates.

    pscluster ps --cluster c.yaml --index 0 --metrics-port 9100   # then scrape 127.0.0.1:9100/metrics
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


def serve(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve registry on http://host:port/metrics; returns the bound port (port 0 picks one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


class PsMetrics:
    """Metrics of one PS task."""

    def __init__(self, shards: Callable[[], float], held: Callable[[], float], step: Callable[[], float],
                 dropped: Callable[[], float], rates: Callable[[], Mapping[str, float]] | None = None,
                 skipped: Callable[[], float] = lambda: 0.0, rejected: Callable[[], float] = lambda: 0.0) -> None:
        self.registry = CollectorRegistry()
        if rates is not None:
            self.registry.register(_RatesCollector(rates))
        self.requests = Counter("pscluster_ps_requests", "Pull/push requests served", ["op", "transport"],
                                registry=self.registry)
        self.bytes = Counter("pscluster_ps_tensor_bytes", "Tensor bytes moved", ["op"], registry=self.registry)
        self.latency = Histogram("pscluster_ps_request_seconds", "Time to serve a pull/push", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        for name, doc, fn in [("pscluster_ps_shards", "Shards held", shards),
                              ("pscluster_ps_bytes_held", "Bytes of shard values held", held),
                              ("pscluster_ps_global_step", "Global step known to this PS", step),
                              ("pscluster_ps_dropped_stale_gradients", "Stale sync gradients dropped", dropped),
                              ("pscluster_ps_skipped_updates", "Shard updates of sync steps skipped: a replica's "
                               "gradient was not finite", skipped),
                              ("pscluster_ps_rejected_nonfinite_pushes", "Pushes refused for a NaN or Inf "
                               "gradient (nan_policy=reject)", rejected)]:
            Gauge(name, doc, registry=self.registry).set_function(fn)
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def observe(self, op: str, transport: str, nbytes: int, started: float) -> None:
        """Count one request that started at perf_counter() `started`."""
        # labels() validates and locks on every call; a PS serves a handful of (op, transport)
        # pairs, so their children are looked up once (a benign race only builds a pair twice).
        children = self._children.get((op, transport))
        if children is None:
            children = (self.requests.labels(op, transport), self.bytes.labels(op), self.latency.labels(op))
            self._children[(op, transport)] = children
        requests, moved, latency = children
        requests.inc()
        moved.inc(nbytes)
        latency.observe(time.perf_counter() - started)


class _RatesCollector(Collector):
    """The learning rate of each variable's next update (its schedule, or the driver's last change), at scrape time."""

    def __init__(self, rates: Callable[[], Mapping[str, float]]) -> None:
        self._rates = rates

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily("pscluster_ps_learning_rate", "Learning rate of the next update of each variable",
                                  labels=["variable"])
        for name, rate in sorted(self._rates().items()):
            gauge.add_metric([name], rate)
        yield gauge


class WorkerMetrics:
    """Metrics of one worker."""

    def __init__(self, nonfinite: Callable[[], dict[str, int]] = dict) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_NonFiniteCollector(nonfinite))
        self.closures = Counter("pscluster_worker_closures", "Closures run", ["outcome"], registry=self.registry)
        self.latency = Histogram("pscluster_worker_closure_seconds", "Time to run a closure",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)


class _NonFiniteCollector(Collector):
    """The worker client's count of pushes whose gradient held NaN or Inf, by what was done with them."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily("pscluster_worker_nonfinite_pushes",
                                     "Pushes whose gradient held NaN or Inf: rejected (an error, nothing "
                                     "pushed) or skipped (the step skipped)", labels=["action"])
        counts = self._counts()
        for action in ("rejected", "skipped"):
            family.add_metric([action], counts.get(action, 0))
        yield family


class CoordinatorCollector(Collector):
    """Reads a coordinator's state at scrape time (nothing on the dispatch path)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        for name, doc in [("queued", "Closures waiting for a worker"), ("running", "Closures running")]:
            yield GaugeMetricFamily(f"pscluster_coordinator_closures_{name}", doc, value=s[name])
        for name, doc in [("done", "Closures completed"), ("retried", "Closures rescheduled after a failure"),
                          ("failed", "Closures that failed")]:
            yield CounterMetricFamily(f"pscluster_coordinator_closures_{name}", doc, value=s[name])
        yield GaugeMetricFamily("pscluster_coordinator_workers_alive", "Workers registered and alive",
                                value=s["workers_alive"])
        yield GaugeMetricFamily("pscluster_coordinator_lost_updates", "Updates lost to PS restarts",
                                value=s["lost_updates"])
        hparams = GaugeMetricFamily("pscluster_coordinator_hyperparameter",
                                    "Hyper-parameters the driver set (set_learning_rate, set_hyperparameters)",
                                    labels=["name"])
        for name, value in sorted(s.get("hyperparameters", {}).items()):
            hparams.add_metric([name], value)
        yield hparams
        rate = GaugeMetricFamily("pscluster_coordinator_worker_steps_per_second",
                                 "Closures completed per second by each worker, last 10 s", labels=["worker"])
        for worker, value in s["rates"].items():
            rate.add_metric([worker], value)
        yield rate


def coordinator_registry(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry whose only collector reads the coordinator's state."""
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(snapshot))
    return registry
