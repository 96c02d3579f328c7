"""FLOOR: W2's data path with nothing but sockets and numpy, the ceiling B2 is measured against.

Two "PS" processes each own half of the MLP's parameters (the same split as examples/mnist.py on 2 PS)
and answer every gradient message with the values after an SGD step (NaN check, update, copy out):
a fused push-pull with no framing, no validation of shapes, no ids, no metrics. Two worker processes
compute the same gradients as B2 and exchange them with both PS processes over one TCP connection
each; there is no coordinator and no closure. The figure is what five processes of this layout can
do on this machine, so B2's ratio to it is the cost of everything pscluster adds (scheduling,
exactly-once, framing, validation), measured in the same run.

With `dispatch=True` a closure is added: the bench process, as an embedded coordinator does, sends
each worker a 1-byte "closure" per step (2 in flight per worker, pscluster's default) and reads its
1-byte "result": W2's message pattern at 1 step per closure, with none of the work. And
`round_trip_floor` times the smallest thing B4 needs: one blocking 1-byte round trip between two
processes over loopback TCP.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import threading
import time
from typing import Any

import numpy as np

from pscluster.net.framing import recv_into

HIDDEN = 128
SPLIT = 392  # w1's rows per PS (w1 is split in two shards, as in examples/mnist.py)
# per PS: the shapes it owns, in message order
SHAPES = {0: [(SPLIT, HIDDEN), (HIDDEN,), (10,)], 1: [(784 - SPLIT, HIDDEN), (HIDDEN, 10)]}


def _size(ps: int) -> int:
    return sum(int(np.prod(s)) for s in SHAPES[ps])


def _ps(index: int, ports: Any, lr: float) -> None:
    rng = np.random.default_rng(index)
    values = [(rng.uniform(-0.05, 0.05, s)).astype(np.float32) for s in SHAPES[index]]
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put((index, listener.getsockname()[1]))

    def serve(conn: socket.socket) -> None:
        grads = np.empty(_size(index), np.float32)
        out = np.empty_like(grads)
        while True:
            try:
                recv_into(conn, memoryview(grads).cast("B"))
            except ConnectionError:  # the worker is done
                break
            offset = 0
            for value in values:
                g = grads[offset:offset + value.size].reshape(value.shape)
                if not np.isfinite(g).all():
                    raise ValueError("non-finite gradient")
                value -= np.float32(lr) * g
                out[offset:offset + value.size] = value.reshape(-1)
                offset += value.size
            conn.sendall(out)
        conn.close()

    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _worker(seed: int, ports: list[int], steps: int, ready: Any, start: Any, done: Any,
            coordinator: int | None = None) -> None:
    from bench.training import mnist

    x, y, _, _ = mnist.load_mnist()
    conns = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    values = [np.empty(_size(i), np.float32) for i in range(2)]
    for conn, v in zip(conns, values):  # the first exchange (zero gradient) brings the initial values
        conn.sendall(np.zeros_like(v))
        recv_into(conn, memoryview(v).cast("B"))
    rng = np.random.default_rng(seed)
    closures = socket.create_connection(("127.0.0.1", coordinator)) if coordinator is not None else None
    if closures is not None:
        closures.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ready.put(seed)
    start.wait()
    cpu = os.times()
    for _ in range(steps):
        if closures is not None and not closures.recv(1):
            break
        idx = rng.integers(0, len(x), 64)
        w1 = np.concatenate([values[0][:SPLIT * HIDDEN], values[1][:(784 - SPLIT) * HIDDEN]]).reshape(784, HIDDEN)
        b1 = values[0][SPLIT * HIDDEN:SPLIT * HIDDEN + HIDDEN]
        b2 = values[0][SPLIT * HIDDEN + HIDDEN:]
        w2 = values[1][(784 - SPLIT) * HIDDEN:].reshape(HIDDEN, 10)
        _, (gw1, gb1, gw2, gb2) = mnist.mlp_grads([w1, b1, w2, b2], x[idx], y[idx])
        conns[0].sendall(np.concatenate([gw1[:SPLIT].reshape(-1), gb1, gb2]))
        conns[1].sendall(np.concatenate([gw1[SPLIT:].reshape(-1), gw2.reshape(-1)]))
        for conn, v in zip(conns, values):
            recv_into(conn, memoryview(v).cast("B"))
        if closures is not None:
            closures.sendall(b"r")
    end = os.times()
    done.put((end.user + end.system) - (cpu.user + cpu.system))
    for conn in conns:
        conn.close()


def _dispatch(listener: socket.socket, workers: int, per: int, inflight: int = 2) -> None:
    """The coordinator's share: keep `inflight` 1-byte closures out per worker until each has run `per`."""
    conns = []
    for _ in range(workers):
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(conn)
    sent = {conn: min(inflight, per) for conn in conns}
    answered = {conn: 0 for conn in conns}
    with selectors.DefaultSelector() as sel:
        for conn in conns:
            conn.sendall(b"c" * sent[conn])
            sel.register(conn, selectors.EVENT_READ)
        while any(answered[c] < per for c in conns):
            for key, _ in sel.select(timeout=60):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                n = len(conn.recv(64))
                if n == 0:
                    raise ConnectionError("a floor worker died")
                answered[conn] += n
                if answered[conn] >= per:  # this worker is done (its EOF follows)
                    sel.unregister(conn)
                more = min(n, per - sent[conn])
                if more > 0:
                    conn.sendall(b"c" * more)
                    sent[conn] += more
    for conn in conns:
        conn.close()


def w2_floor(steps: int = 2000, workers: int = 2, lr: float = 0.1, dispatch: bool = False) -> dict[str, float]:
    """W2 async over bare sockets (2 PS processes, `workers` worker processes): steps/s and worker CPU per step
    (with `dispatch`, every step is a 1-byte closure sent by this process, as W2 at 1 step per closure)."""
    ctx = mp.get_context("spawn")  # the bench process has gRPC threads: never fork it
    ports_q, ready, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    servers = [ctx.Process(target=_ps, args=(i, ports_q, lr), daemon=True) for i in range(2)]
    procs: list[Any] = list(servers)
    try:
        for p in servers:
            p.start()
        ports = dict(ports_q.get(timeout=60) for _ in servers)
        per = steps // workers
        listener = socket.create_server(("127.0.0.1", 0)) if dispatch else None
        coordinator = listener.getsockname()[1] if listener is not None else None
        clients = [ctx.Process(target=_worker, args=(w, [ports[0], ports[1]], per, ready, start, done, coordinator),
                               daemon=True) for w in range(workers)]
        procs += clients
        for p in clients:
            p.start()
        for _ in clients:
            ready.get(timeout=120)
        began, cpu = time.perf_counter(), time.process_time()
        start.set()
        if listener is not None:
            with listener:
                _dispatch(listener, workers, per)
        worker_cpu = sum(done.get(timeout=600) for _ in clients)
        seconds = time.perf_counter() - began
        return {"steps_per_s": per * workers / seconds, "worker_cpu_us_per_step": worker_cpu / (per * workers) * 1e6,
                "coordinator_cpu_us_per_step": (time.process_time() - cpu) / (per * workers) * 1e6}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _echo(port: int) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while byte := conn.recv(1):
        conn.sendall(byte)
    conn.close()


def round_trip_floor(round_trips: int = 5000, batches: int = 5) -> dict[str, float]:
    """One blocking 1-byte round trip between this process and another over loopback TCP: median over
    batches of the mean wall time, and this process's CPU, per round trip (us)."""
    ctx = mp.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = ctx.Process(target=_echo, args=(listener.getsockname()[1],), daemon=True)
        peer.start()
        try:
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                walls, cpus = [], []
                for _ in range(batches):
                    wall, cpu = time.perf_counter(), time.process_time()
                    for _ in range(round_trips // batches):
                        conn.sendall(b"x")
                        if not conn.recv(1):
                            raise ConnectionError("the echo process died")
                    walls.append((time.perf_counter() - wall) / (round_trips // batches) * 1e6)
                    cpus.append((time.process_time() - cpu) / (round_trips // batches) * 1e6)
        finally:
            peer.join(timeout=5)
            if peer.is_alive():
                peer.kill()
                peer.join(timeout=5)
    walls.sort()
    cpus.sort()
    return {"round_trip_us": walls[len(walls) // 2], "cpu_us": cpus[len(cpus) // 2]}
