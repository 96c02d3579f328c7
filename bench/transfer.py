"""B1 (100 MB pull/push over 2 PS vs raw TCP and raw gRPC, same run) and B9 (PS memory with 1 GB)."""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np

import pscluster as ps
from bench.common import local_cluster, median_of, reset_peak, rss_kib, timed
from pscluster.ops.launcher import LocalCluster, free_port

HERE = pathlib.Path(__file__).resolve().parent
MB = 1_000_000


@contextlib.contextmanager
def peer(kind: str, nbytes: int) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "peers.py"), kind, str(port), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        yield port
    finally:
        proc.kill()
        proc.wait()


def raw_tcp(nbytes: int, runs: int) -> dict[str, float]:
    """GB/s of one TCP connection on loopback: receive into / send from a numpy buffer."""
    with peer("tcp-server", nbytes) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        buf = np.empty(nbytes, np.uint8)
        data = np.ones(nbytes, np.uint8)

        def pull() -> None:
            conn.sendall(b"s")
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)

        def push() -> None:
            conn.sendall(b"r")
            conn.sendall(memoryview(data))
            conn.recv(1)

        pull_s, _ = median_of(lambda: timed(pull), runs)
        push_s, _ = median_of(lambda: timed(push), runs)
    return {"tcp_pull_gbps": nbytes / pull_s / 1e9, "tcp_push_gbps": nbytes / push_s / 1e9}


def raw_grpc(nbytes: int, runs: int) -> dict[str, float]:
    """GB/s of plain grpcio: one message, and a stream of 4 MiB chunks."""
    import grpc

    with peer("grpc-server", nbytes) as port:
        opts = [("grpc.max_receive_message_length", nbytes + 1024)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            ident = lambda b: b  # noqa: E731
            stream = ch.unary_stream("/raw/Pull", request_serializer=ident, response_deserializer=ident)
            one = ch.unary_unary("/raw/One", request_serializer=ident, response_deserializer=ident)
            buf = np.empty(nbytes, np.uint8)

            def pull_stream() -> None:
                pos = 0
                for chunk in stream(b""):
                    buf[pos:pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    pos += len(chunk)

            stream_s, _ = median_of(lambda: timed(pull_stream), runs)
            one_s, _ = median_of(lambda: timed(lambda: one(b"")), runs)
    return {"grpc_stream_gbps": nbytes / stream_s / 1e9, "grpc_one_message_gbps": nbytes / one_s / 1e9}


def pscluster_transfer(nbytes: int, runs: int, bulk: bool = True, tls: bool = False,
                       shared_memory: bool = False) -> dict[str, float]:
    """GB/s of pull and push (+SGD on the PS) of one float32 variable in 2 shards over 2 PS (mutual TLS if tls;
    over loopback TCP unless shared_memory, which same-host clients use by default)."""
    with local_cluster(2, 0, tls=tls) as cluster:
        with ps.PSClient(cluster.settings(bulk_transport=bulk, shared_memory=shared_memory)) as client:
            var = client.create_variable("big", shape=(nbytes // 4 // 1024, 1024), dtype="float32",
                                         partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(0.0))
            grad = np.ones(var.shape, np.float32)
            client.pull([var])
            pull_s, pulls = median_of(lambda: timed(lambda: client.pull([var])), runs)
            push_s, pushes = median_of(lambda: timed(lambda: client.push([(var, grad)])), runs)
    tag = ("" if bulk else "_grpc") + ("_tls" if tls else "") + ("_shm" if shared_memory else "")
    return {f"ps_pull{tag}_gbps": nbytes / pull_s / 1e9, f"ps_push{tag}_gbps": nbytes / push_s / 1e9}


def b1(runs: int = 5, nbytes: int = 100 * MB) -> dict[str, float]:
    """B1: pscluster pull/push next to raw TCP and raw gRPC, one run."""
    out: dict[str, float] = {}
    out.update(raw_tcp(nbytes, runs))
    out.update(raw_grpc(nbytes, runs))
    out.update(pscluster_transfer(nbytes, runs))
    out.update(pscluster_transfer(nbytes, runs, bulk=False))
    out.update(pscluster_transfer(nbytes, runs, shared_memory=True))
    out["pull_vs_tcp"] = out["ps_pull_gbps"] / out["tcp_pull_gbps"]
    out["push_vs_tcp"] = out["ps_push_gbps"] / out["tcp_push_gbps"]
    return out


def b1_tls(runs: int = 5, nbytes: int = 100 * MB) -> dict[str, float]:
    """B1 with mutual TLS on the bulk path beside plaintext, same run."""
    out: dict[str, float] = {}
    out.update(pscluster_transfer(nbytes, runs))
    out.update(pscluster_transfer(nbytes, runs, tls=True))
    out["pull_tls_ratio"] = out["ps_pull_tls_gbps"] / out["ps_pull_gbps"]
    out["push_tls_ratio"] = out["ps_push_tls_gbps"] / out["ps_push_gbps"]
    return out


def b9(gib: float = 1.0) -> dict[str, float]:
    """B9: peak RSS of a PS holding a 1 GB float32 variable (SGD) while 2 clients pull it concurrently."""
    nbytes = int(gib * (1 << 30))
    with LocalCluster(1, 0) as cluster:
        pid = cluster.ps[0].pid
        baseline = rss_kib(pid) * 1024
        with ps.PSClient(cluster.settings()) as c1, ps.PSClient(cluster.settings()) as c2:
            var = c1.create_variable("huge", shape=(nbytes // 4 // 4096, 4096), dtype="float32",
                                     optimizer=ps.SGD(0.1))
            c1.push([(var, np.zeros(var.shape, np.float32))])  # one SGD update as well
            reset_peak(pid)
            threads = [threading.Thread(target=c.pull, args=([var],)) for c in (c1, c2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak = rss_kib(pid, "VmHWM") * 1024
    return {"variable_bytes": float(nbytes), "baseline_rss": float(baseline), "peak_rss_during_pulls": float(peak),
            "ratio": (peak - baseline) / nbytes}
