"""Shared-memory segments (pscluster/net/shm.py): both ends see one region; bad offers are refused."""

import os
import subprocess
import sys

import pytest

from pscluster.errors import FailedPreconditionError
from pscluster.net import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="this host has no writable /dev/shm")


def _exists(name):
    return os.path.exists(os.path.join(shm.DIRECTORY, name))


def test_an_attached_segment_is_one_region_for_both_ends_and_its_name_is_gone():
    mine, nonce = shm.Segment.create(shm.size_for(100_000))
    theirs = shm.Segment.attach(mine.name, nonce, shm.HEADER_BYTES + mine.capacity, shm.MAX_BYTES)
    try:
        assert mine.capacity == theirs.capacity == 1 << 17
        mine.region[:5] = [1, 2, 3, 4, 5]
        assert list(theirs.region[:5]) == [1, 2, 3, 4, 5]
        theirs.region[-1] = 9
        assert mine.region[-1] == 9
        assert not _exists(mine.name)  # attached: nothing is left behind when either end dies
    finally:
        mine.close()
        theirs.close()


def test_size_for_is_a_power_of_two_region_at_least_min_bytes():
    assert shm.size_for(1) - shm.HEADER_BYTES == shm.MIN_BYTES
    assert shm.size_for(shm.MIN_BYTES + 1) - shm.HEADER_BYTES == 2 * shm.MIN_BYTES
    assert shm.size_for(1 << 20) - shm.HEADER_BYTES == 1 << 20


@pytest.mark.parametrize("name", ["../etc/passwd", "other-name", "pscluster-a/b", "pscluster-missing"])
def test_names_that_are_not_a_pscluster_segment_here_are_refused(name):
    with pytest.raises(FailedPreconditionError):
        shm.Segment.attach(name, b"x" * shm.NONCE_BYTES, shm.size_for(1), shm.MAX_BYTES)


def test_a_wrong_nonce_or_size_is_refused_and_leaves_the_name_to_its_owner():
    mine, nonce = shm.Segment.create(shm.size_for(1))
    size = shm.HEADER_BYTES + mine.capacity
    try:
        with pytest.raises(FailedPreconditionError, match="another host"):
            shm.Segment.attach(mine.name, bytes(shm.NONCE_BYTES), size, shm.MAX_BYTES)
        with pytest.raises(FailedPreconditionError, match="not .* bytes"):
            shm.Segment.attach(mine.name, nonce, size * 2, shm.MAX_BYTES)
        with pytest.raises(FailedPreconditionError, match="outside"):
            shm.Segment.attach(mine.name, nonce, size, mine.capacity // 2)
        assert _exists(mine.name)
    finally:
        shm.unlink(mine.name)
        mine.close()
    assert not _exists(mine.name)


def test_closing_a_segment_twice_does_nothing_the_second_time():
    segment, _ = shm.Segment.create(shm.size_for(1000))
    shm.unlink(segment.name)
    segment.close()
    segment.close()  # a link's close racing its sender's replacement of the segment


def test_sweep_removes_the_names_of_processes_that_no_longer_run_and_keeps_the_others():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    names = {"dead": f"{shm.PREFIX}{gone.pid}-sweeptest", "self": f"{shm.PREFIX}{os.getpid()}-sweeptest",
             "parent": f"{shm.PREFIX}{os.getppid()}-sweeptest", "other": "not-pscluster-sweeptest"}
    try:
        for name in names.values():
            with open(os.path.join(shm.DIRECTORY, name), "wb") as f:
                f.write(b"x")
        removed = shm.sweep()
        assert names["dead"] in removed and not _exists(names["dead"])
        assert all(_exists(names[k]) for k in ("self", "parent", "other"))  # running, or not a segment
    finally:
        for name in names.values():
            shm.unlink(name)
