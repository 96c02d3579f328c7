"""Ports LocalCluster plans ahead: chosen where neither bind(0) nor outgoing connections land."""

import socket

from pscluster.ops.launcher import _ephemeral_floor, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    floor = _ephemeral_floor()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < floor for p in ports)
    assert len(ports) > 1  # random, so two clusters planned at once rarely pick the same port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bound_port_is_never_returned():
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == 50
    finally:
        for s in held:
            s.close()
