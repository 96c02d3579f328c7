"""Closure dispatch over a framed connection to a worker that answers garbage: real sockets, in-process."""

import socket
import threading

from pscluster.coordinator.dispatch import FramedDispatcher
from pscluster.proto import pscluster_pb2 as pb

from pscluster.net.framing import PREFIX


def test_a_garbage_reply_fails_the_attempt_instead_of_killing_the_reader():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    port = listener.getsockname()[1]

    def garbage_worker():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            header_len, _ = PREFIX.unpack(conn.recv(PREFIX.size, socket.MSG_WAITALL))
            conn.recv(header_len, socket.MSG_WAITALL)
            conn.sendall(PREFIX.pack(4, 0) + b"\xff\xff\xff\xff")  # a header that does not parse
            conn.recv(1)  # hold the connection until the dispatcher closes it

    worker = threading.Thread(target=garbage_worker, name="test-garbage-worker")
    worker.start()
    failed, done = [], threading.Event()
    dispatcher = FramedDispatcher(None, on_reply=lambda *a: None,
                                  on_failure=lambda cid, wid, reason: (failed.append((cid, wid, reason)), done.set()))
    try:
        dispatcher.dispatch("w0", f"127.0.0.1:{port}", pb.RunClosureRequest(closure_id=7, attempt=1))
        assert done.wait(30)
        assert failed[0][:2] == (7, "w0") and "closure connection failed" in failed[0][2]
    finally:
        dispatcher.close()
        worker.join(timeout=30)
        listener.close()
