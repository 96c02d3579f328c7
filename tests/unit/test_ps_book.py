"""The coordinator's PS list (coordinator/ps_book.py): joins get the next index, the same address the same
one, only the last joined PS leaves, and a restarted coordinator takes a newer list; bad input changes nothing."""

from __future__ import annotations

import pytest
from pscluster.coordinator.ps_book import PsBook

from pscluster.errors import FailedPreconditionError, InvalidArgumentError

FILE = ["127.0.0.1:7001", "127.0.0.1:7002"]


def test_a_joining_ps_gets_the_next_index_and_the_same_address_again_gets_the_same_one() -> None:
    book = PsBook.from_file(FILE)
    assert (book.listed, book.epoch) == (2, 0)
    assert book.join("127.0.0.1:7003") == (2, True) and book.epoch == 1
    assert book.join("127.0.0.1:7003") == (2, False) and book.epoch == 1  # a restarted PS rejoins as itself
    assert book.join("127.0.0.1:7001") == (0, False)  # a listed PS asking is told its own index
    assert book.join("127.0.0.1:7004") == (3, True) and book.addresses[2:] == ["127.0.0.1:7003", "127.0.0.1:7004"]


@pytest.mark.parametrize("address", ["", "7003", "host:", ":7003", "host:http", "host:0", "host:70000"])
def test_a_join_without_a_host_and_port_is_refused_and_changes_nothing(address: str) -> None:
    book = PsBook.from_file(FILE)
    with pytest.raises(InvalidArgumentError, match="is not a host:port address"):
        book.join(address)
    assert book == PsBook.from_file(FILE)


def test_only_the_last_joined_ps_leaves_and_listed_ones_never_do() -> None:
    book = PsBook.from_file(FILE)
    book.join("127.0.0.1:7003")
    book.join("127.0.0.1:7004")
    with pytest.raises(FailedPreconditionError, match="ps 2 cannot leave before ps 3"):
        book.leave(2)
    with pytest.raises(FailedPreconditionError, match="listed in the cluster file"):
        book.leave(1)
    with pytest.raises(InvalidArgumentError, match="unknown PS task 9"):
        book.leave(9)
    assert len(book.addresses) == 4 and book.epoch == 2
    book.leave(3)
    book.leave(2)
    assert book.addresses == FILE and book.epoch == 4


def test_a_restarted_coordinator_takes_a_newer_list_only() -> None:
    book = PsBook.from_file(FILE)
    assert not book.adopt(FILE, 0)  # nothing joined: the file's list holds
    assert not book.adopt([], 5)  # a PS that never had a table
    assert not book.adopt(FILE[:1], 5)  # fewer than the file lists: not this cluster's list
    assert book.adopt([*FILE, "127.0.0.1:7003"], 3) and book.epoch == 3 and len(book.addresses) == 3
    assert not book.adopt(FILE, 2)
    assert book.join("127.0.0.1:7003") == (2, False)
