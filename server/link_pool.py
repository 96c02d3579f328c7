"""Replica links opened before they are needed (elastic PS, docs/elastic.md: the join freeze).

A PS opens a replica link (server/replica_links.py: a gRPC channel, the TLS context, the framed socket's
settings) when a SetRoles first makes it the primary of a shard whose backup it has no link to. The first
link a process opens costs tens of milliseconds on a loaded machine (gRPC's client machinery starts in the
process), and for a PS that joined, that first SetRoles is the switch that ends an elastic move's freeze:
the freeze grew by that cost (B15SCALE's unlisted-PS joins: 54 ms, once 168 ms, at load 8). So when the
PS list arrives (at start, and on each SetRoles that brings a new list, long before any move) the pool
opens a link to every other PS of the list; `take` hands each out once (its replicator owns and closes
it), and opens one at once for an address it has none for. Links are keyed by address: a task index
reused by another PS (one left, another joined) gets a new link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pscluster.server.replicator import ReplicaLink


class LinkPool:
    """Links to PS addresses, opened ahead; owned by the PS's main and closed by `close`."""

    def __init__(self, open_link: Callable[[str], ReplicaLink]) -> None:
        self._open = open_link
        self._lock = threading.Lock()  # _ready only; a link is opened and closed outside it
        self._ready: dict[str, ReplicaLink] = {}
        self._closed = False

    def prepare(self, addresses: Sequence[str], own: str) -> int:
        """Open a link to each address but own that has none ready; returns how many it opened. A link to an
        address that left the list is closed."""
        wanted = {a for a in addresses if a and a != own}
        with self._lock:
            stale = [self._ready.pop(a) for a in list(self._ready) if a not in wanted]
            missing = sorted(wanted - self._ready.keys())
        for link in stale:
            link.close()
        opened = 0
        for address in missing:
            link = self._open(address)
            with self._lock:
                keep = not self._closed and address not in self._ready
                if keep:
                    self._ready[address] = link
            if keep:
                opened += 1
            else:
                link.close()  # another prepare got there first, or the pool closed meanwhile
        return opened

    def take(self, address: str) -> ReplicaLink:
        """A link to address, from now on owned by the caller: the one prepared, or a new one."""
        with self._lock:
            link = self._ready.pop(address, None)
        return link if link is not None else self._open(address)

    def close(self) -> None:
        """Close the links no one took."""
        with self._lock:
            self._closed = True
            links, self._ready = list(self._ready.values()), {}
        for link in links:
            link.close()
