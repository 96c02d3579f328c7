"""framing.recv_into's first read without a poll (bytes already there) and its fallback (bytes still to come),
over an in-process socket pair: the same bytes, EOF and timeouts as before."""

from __future__ import annotations

import socket
import threading

import pytest

from pscluster.net import framing


def _pair(timeout: float | None = 2.0) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(timeout)
    b.settimeout(timeout)
    return a, b


def test_bytes_already_there_and_bytes_still_to_come_are_both_read() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(b"0123")
        target = bytearray(8)
        later = threading.Timer(0.05, lambda: a.sendall(b"4567"))
        later.start()
        framing.recv_into(b, memoryview(target))  # 4 at once, then waits (bounded) for the rest
        later.join()
        assert bytes(target) == b"01234567"
        a.sendall(b"xy")
        assert framing.recv_exact(b, 2, ready=False) == b"xy"


@pytest.mark.parametrize("timeout", [2.0, None])
def test_eof_raises_connection_error(timeout: float | None) -> None:
    a, b = _pair(timeout)
    with b:
        a.sendall(b"ab")
        a.close()
        with pytest.raises(ConnectionError):
            framing.recv_exact(b, 4)
        with pytest.raises(ConnectionError):
            framing.recv_exact(b, 1)


def test_a_peer_that_stops_sending_times_out() -> None:
    a, b = _pair(0.1)
    with a, b:
        a.sendall(b"ab")
        with pytest.raises(TimeoutError):
            framing.recv_exact(b, 4)
