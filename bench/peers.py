"""Peers measured in the same run as pscluster: plain TCP, plain gRPC streaming, TF's sparse workload.

Run as `python bench/peers.py tcp-server PORT NBYTES` or `grpc-server PORT NBYTES`; the client side
lives in transfer.py. `PYTHON bench/peers.py tf-sparse ROWS DIM`, under a Python with tensorflow-cpu
2.21 (an optional environment, never the project's), runs TF ParameterServerStrategy on B13's workload
(bench/sparse.py drives it). Loopback only.
"""

from __future__ import annotations

import os
import socket
import sys
from concurrent import futures

import numpy as np

CHUNK = 4 << 20


def tcp_server(port: int, nbytes: int) -> None:
    """Per connection: 1 byte op ('s' send nbytes, 'r' receive nbytes and ack)."""
    data = np.ones(nbytes, np.uint8)
    sink = np.empty(nbytes, np.uint8)
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("READY", flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                while True:
                    op = conn.recv(1)
                    if not op:
                        break
                    if op == b"s":
                        conn.sendall(memoryview(data))
                    else:
                        view, got = memoryview(sink), 0
                        while got < nbytes:
                            got += conn.recv_into(view[got:], nbytes - got)
                        conn.sendall(b"k")


def grpc_server(port: int, nbytes: int) -> None:
    """A generic gRPC service: /raw/Pull streams nbytes in 4 MiB chunks; /raw/One sends one message."""
    import grpc

    blob = bytes(nbytes)
    chunks = [blob[i:i + CHUNK] for i in range(0, nbytes, CHUNK)]

    def pull(request: bytes, context: object):  # type: ignore[no-untyped-def]
        yield from chunks

    def one(request: bytes, context: object) -> bytes:
        return blob

    ident = lambda b: b  # noqa: E731
    handler = grpc.method_handlers_generic_handler("raw", {
        "Pull": grpc.unary_stream_rpc_method_handler(pull, ident, ident),
        "One": grpc.unary_unary_rpc_method_handler(one, ident, ident),
    })
    opts = [("grpc.max_send_message_length", nbytes + 1024), ("grpc.max_receive_message_length", nbytes + 1024)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("READY", flush=True)
    server.wait_for_termination()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of pid so far (/proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tf_server(cluster_json: str, job: str, index: int) -> None:
    """One TF task (ps or worker) of a local ParameterServerStrategy cluster; runs until killed."""
    import json

    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(cluster_json)), job_name=job, task_index=index,
                                  protocol="grpc", start=True)
    server.join()


def tf_sparse(rows: int, dim: int) -> None:
    """B13 in TF, as ../shared/BENCHMARKS.md sets it up: 2 PS + 2 worker processes, this process the chief.

    Prints {"create_s"} once the table exists, then for each stdin line `CLOSURES WARMUP BATCH` one
    repetition's {"rows_per_s"}; ends (and ends its servers) at end of input.
    """
    import json
    import subprocess
    import time

    ports = _free_ports(5)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{p}" for p in ports[1:3]],
               "worker": [f"127.0.0.1:{p}" for p in ports[3:5]]}
    spec = json.dumps(cluster)
    tasks = [(job, i) for job in ("ps", "worker") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "tf-server", spec, job, str(i)], stdout=subprocess.DEVNULL)
             for job, i in tasks]
    try:
        import tensorflow as tf

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        made = time.perf_counter()
        def uniform(shape=None, dtype=None, partition_shape=None, partition_offset=None):  # type: ignore[no-untyped-def]
            # called per shard on its PS (a whole 2.4 GiB value made here would not fit one protobuf)
            return tf.random.uniform(partition_shape or shape, -0.05, 0.05)

        with strategy.scope():
            table = tf.Variable(uniform, shape=[rows, dim], dtype=tf.float32)
        create_s = time.perf_counter() - made

        def make_dataset(batch: int):  # type: ignore[no-untyped-def]
            def dataset_fn():  # type: ignore[no-untyped-def]
                return tf.data.Dataset.from_tensors(0).repeat().map(
                    lambda _: tf.random.uniform([batch], 0, rows, tf.int64))
            return coordinator.create_per_worker_dataset(dataset_fn)

        @tf.function
        def step(iterator):  # type: ignore[no-untyped-def]
            ids = next(iterator)
            with tf.GradientTape() as tape:
                found = tf.nn.embedding_lookup(table, ids)
                loss = tf.reduce_sum(found * found)
            grads = tape.gradient(loss, table.variables)
            for shard, g in zip(table.variables, grads):
                if g is not None:
                    shard.scatter_sub(tf.IndexedSlices(0.01 * g.values, g.indices))
            return loss

        print(json.dumps({"create_s": create_s}), flush=True)
        iterators: dict[int, object] = {}
        for line in sys.stdin:
            closures, warmup, batch = (int(x) for x in line.split())
            if batch not in iterators:
                iterators[batch] = iter(make_dataset(batch))
            it = iterators[batch]
            for _ in range(warmup):
                coordinator.schedule(step, args=(it,))
            coordinator.join()
            pids = {"chief": os.getpid(), **{f"{job}{i}": p.pid for (job, i), p in zip(tasks, procs)}}
            before = {role: _cpu_s(pid) for role, pid in pids.items()}
            start = time.perf_counter()
            for _ in range(closures):
                coordinator.schedule(step, args=(it,))
            coordinator.join()
            rate = 2 * batch * closures / (time.perf_counter() - start)
            cpu = {role: (_cpu_s(pid) - before[role]) / closures * 1e3 for role, pid in pids.items()}
            print(json.dumps({"rows_per_s": rate, "cpu_ms": cpu}), flush=True)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "tf-sparse":
        tf_sparse(int(sys.argv[2]), int(sys.argv[3]))
    elif kind == "tf-server":
        tf_server(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        port, nbytes = int(sys.argv[2]), int(sys.argv[3])
        (tcp_server if kind == "tcp-server" else grpc_server)(port, nbytes)
