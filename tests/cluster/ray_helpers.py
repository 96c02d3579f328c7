"""Waiting on a RayCluster from tests."""

from __future__ import annotations

import time
from typing import Any


def wait_for_new_address(cluster: Any, index: int, old: str, timeout: float) -> str:
    """The address PS `index` registers in the cluster's directory once it is back somewhere other than `old`."""
    deadline = time.monotonic() + timeout
    while cluster.resolver(index) in ("", old):
        assert time.monotonic() < deadline, "the PS actor never came back"
        time.sleep(0.05)
    return str(cluster.resolver(index))
