"""Replica links opened when the PS list arrives, so the SetRoles that ends a move's freeze opens none."""

import threading

import numpy as np
from pscluster.server.link_pool import LinkPool
from pscluster.server.ps import ParameterServerCore
from pscluster.server.replication import Replication, Role
from pscluster.server.store import ShardSpec

from pscluster.errors import UnavailableError
from pscluster.optimizers import SGD

ADDRESSES = ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]


class FakeLink:
    """A link that records its address and whether it was closed (no socket)."""

    def __init__(self, address):
        self.address, self.closed = address, False

    def replicate(self, request, arrays, timeout):
        raise UnavailableError(f"{self.address}: no backup in this test")

    def close(self):
        self.closed = True


def counting_pool():
    opened = []

    def open_link(address):
        opened.append(FakeLink(address))
        return opened[-1]

    return LinkPool(open_link), opened


def test_prepare_opens_one_link_per_other_ps_and_take_hands_each_out_once():
    pool, opened = counting_pool()
    assert pool.prepare(ADDRESSES, ADDRESSES[0]) == 2
    assert pool.prepare(ADDRESSES, ADDRESSES[0]) == 0  # the same list again opens nothing
    first = pool.take(ADDRESSES[1])
    assert first is opened[0] and len(opened) == 2
    again = pool.take(ADDRESSES[1])  # taken already: a new one, opened now
    assert again is opened[2] and len(opened) == 3


def test_a_list_without_an_address_closes_its_link_and_close_closes_the_rest():
    pool, opened = counting_pool()
    pool.prepare(ADDRESSES, ADDRESSES[0])
    pool.prepare(ADDRESSES[:2], ADDRESSES[0])  # ps 2 left the list
    assert [(link.address, link.closed) for link in opened] == [(ADDRESSES[1], False), (ADDRESSES[2], True)]
    pool.close()
    assert all(link.closed for link in opened)
    assert pool.prepare(ADDRESSES, ADDRESSES[0]) == 0 and opened[-1].closed  # a closed pool keeps nothing


def test_the_set_roles_that_makes_a_joined_ps_primary_opens_no_link():
    core = ParameterServerCore(2, 2)
    pool, opened = counting_pool()
    core.links = pool
    core.replication = Replication(core.store, 2, lambda ps: pool.take(core.addresses[ps]))
    try:
        spec = ShardSpec("c", 0, 1, (), (), 0, "<i8", SGD(1.0), False, 0)
        core.create(spec, np.zeros((), np.int64), "zeros", 0.0, 0)
        core.take_roles(1, [Role(spec.key, 1, 0, 2)], ADDRESSES, 1)  # it joined: a backup, catching up
        before = len(opened)
        assert before == 2
        core.take_roles(2, [Role(spec.key, 2, 2, 1)], ADDRESSES, 1)  # the switch: primary, ps 1 its backup
        assert len(opened) == before  # the link to ps 1 was opened when the list arrived, before the freeze
    finally:
        core.replication.stop()
        pool.close()


class SlowList(list):
    """A PS list whose copy pauses until told to go: holds a SetRoles between its epoch check and its write."""

    def __init__(self, items, entered, go):
        super().__init__(items)
        self.entered, self.go = entered, go

    def __iter__(self):
        self.entered.set()
        assert self.go.wait(10.0)
        return super().__iter__()


def test_an_older_ps_list_applied_last_by_a_racing_set_roles_changes_nothing():
    core = ParameterServerCore(0, 2)
    pool, opened = counting_pool()
    core.links = pool
    entered, go = threading.Event(), threading.Event()
    older = threading.Thread(target=core.take_ps_list, args=(SlowList(ADDRESSES[:2], entered, go), 4))
    newer = threading.Thread(target=core.take_ps_list, args=(ADDRESSES, 5))
    older.start()
    try:
        assert entered.wait(10.0)
        newer.start()
        newer.join(1.0)  # done, or waiting for the older one to finish its check-and-set
    finally:
        go.set()
        older.join(10.0)
        newer.join(10.0)
    assert not older.is_alive() and not newer.is_alive()
    assert (core.addresses, core.ps_epoch, core.num_ps) == (ADDRESSES, 5, 3)
    live = sorted(link.address for link in opened if not link.closed)
    assert live == ADDRESSES[1:]  # the links follow the newest list: ps 2's was not closed by the older one
    pool.close()
