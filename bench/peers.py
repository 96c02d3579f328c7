"""Raw transfer peers measured in the same run as pscluster: plain TCP and plain gRPC streaming.

Run as `python bench/peers.py tcp-server PORT NBYTES` or `grpc-server PORT NBYTES`; the client side
lives in transfer.py. Loopback only.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    kind, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    (tcp_server if kind == "tcp-server" else grpc_server)(port, nbytes)
