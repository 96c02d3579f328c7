"""The PS list the coordinator owns (elastic PS, docs/elastic.md): the address of every PS task, epoch-numbered.

It starts as the cluster file's `ps` list. A PS daemon started with `--join` adds itself (JoinPs): it gets
the next task index, and the same address asking again (a restart) gets the same one. A PS that joined
leaves once a scale drained it. Indices stay dense, 0..P-1, because clients place shard `k` on `k mod P`
and checkpoint files are named `ps-<i>-of-<P>`: only the last PS task of the list can leave, and the
listed ones (the cluster file's) never do: a drained listed PS stays in the list, holding nothing.

The list travels with the replica table (SetRoles/GetRoles carry it), so every PS, client and worker
that re-reads the table learns it, and a restarted coordinator goes on from the newest one a PS holds.
Pure: no I/O; replica_keeper.py holds one and opens the channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pscluster.errors import FailedPreconditionError, InvalidArgumentError


@dataclass
class PsBook:
    """PS task index -> address; `listed` of them come from the cluster file; `epoch` counts changes."""

    addresses: list[str] = field(default_factory=list)
    listed: int = 0
    epoch: int = 0

    @classmethod
    def from_file(cls, addresses: Sequence[str]) -> PsBook:
        """The list a cluster file names (epoch 0)."""
        return cls(list(addresses), len(addresses), 0)

    def join(self, address: str) -> tuple[int, bool]:
        """The task index of the PS at address, adding it at the end if new; (index, added).

        Raises:
            InvalidArgumentError: not a host:port address.
        """
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"JoinPs: {address!r} is not a host:port address of a PS's gRPC server")
        if address in self.addresses:
            return self.addresses.index(address), False
        self.addresses.append(address)
        self.epoch += 1
        return len(self.addresses) - 1, True

    def check_leave(self, index: int) -> None:
        """Refuse a leave that would break the dense indices or remove a listed PS.

        Raises:
            InvalidArgumentError: an unknown index.
            FailedPreconditionError: a listed PS, or one that is not the last of the list.
        """
        if not 0 <= index < len(self.addresses):
            raise InvalidArgumentError(f"unknown PS task {index}: this cluster has PS tasks 0..{len(self.addresses) - 1}")
        if index < self.listed:
            raise FailedPreconditionError(f"ps {index} is listed in the cluster file: it stays in the PS list (drained) "
                                          "and leaves only with the file")
        if index != len(self.addresses) - 1:
            raise FailedPreconditionError(f"ps {index} cannot leave before ps {len(self.addresses) - 1}: task indices "
                                          "stay 0..P-1 (placement is k mod P and checkpoint files are ps-i-of-P)")

    def leave(self, index: int) -> None:
        """Remove the last PS task (it joined, and a scale drained it)."""
        self.check_leave(index)
        self.addresses.pop()
        self.epoch += 1

    def adopt(self, addresses: Sequence[str], epoch: int) -> bool:
        """Take a newer list that a PS holds (a restarted coordinator); True if it was newer."""
        if not addresses or epoch <= self.epoch or len(addresses) < self.listed:
            return False
        self.addresses, self.epoch = list(addresses), epoch
        return True
