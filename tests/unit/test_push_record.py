"""The exactly-once record stays as small as the closures in flight and still refuses every copy."""

import numpy as np
import pytest
from pscluster.server import push_record
from pscluster.server.push_record import PushRecord, closure_of
from pscluster.server.store import PushItem, ShardSpec, VariableStore

from pscluster.specs import OptimizerConfig

PREFIX = 0xABCDEF << 32


def test_closure_ids_are_read_from_closure_push_ids_only():
    assert closure_of(f"c{PREFIX + 7}.0") == PREFIX + 7
    assert [closure_of(x) for x in ("u1f2e", "c12", "cx.0", "sync:3", "")] == [None] * 5


def test_the_record_follows_the_closures_in_flight_not_the_steps():
    record = PushRecord()
    in_flight = 16
    for i in range(200_000):
        cid = PREFIX + i
        record.advance(cid - in_flight + 1)  # the coordinator's mark: older closures are final
        record.add(f"c{cid}.0")
        assert len(record) <= in_flight
    # a retried closure in flight re-sends its id: refused; a new id is not
    last = PREFIX + 199_999
    assert record.seen(f"c{last}.0") and not record.seen(f"c{last}.1") and not record.seen(f"c{last + 1}.0")


def test_a_late_copy_from_a_final_closure_is_refused_even_when_forgotten():
    record = PushRecord()
    record.add(f"c{PREFIX + 5}.0")
    record.advance(PREFIX + 10)  # closure 5 is final: its id is forgotten ...
    assert len(record) == 0
    assert record.seen(f"c{PREFIX + 5}.0") and record.seen(f"c{PREFIX + 9}.3")  # ... and copies refused
    assert not record.seen(f"c{PREFIX + 10}.0")
    record.advance(PREFIX + 3)  # marks only rise (pushes carry the mark of their dispatch)
    assert record.seen(f"c{PREFIX + 9}.0")


def test_other_ids_and_old_coordinators_are_bounded():
    record = PushRecord()
    for i in range(push_record.OTHER_IDS + 100):
        record.add(f"u{i}")
    assert len(record) == push_record.OTHER_IDS and record.seen(f"u{push_record.OTHER_IDS + 99}")
    record = PushRecord()
    for k in range(push_record.PREFIXES + 5):  # coordinators restarted: a new prefix each
        record.add(f"c{(k << 32) + 1}.0")
    assert len(record) == push_record.PREFIXES
    assert record.seen(f"c{((push_record.PREFIXES + 4) << 32) + 1}.0") and not record.seen(f"c{1}.0")


def test_the_window_caps_a_coordinator_that_sends_no_mark():
    record = PushRecord(window=1000)
    for i in range(5000):
        record.add(f"c{PREFIX + i}.0")
    assert len(record) == 1000


def test_state_round_trips_and_old_checkpoints_load():
    record = PushRecord()
    for i in range(20):
        record.add(f"c{PREFIX + i}.0")
    record.add("u9")
    record.advance(PREFIX + 15)
    again = PushRecord.from_state(record.state())
    assert len(again) == len(record) == 6
    assert again.seen(f"c{PREFIX + 3}.0") and again.seen(f"c{PREFIX + 17}.0") and again.seen("u9")
    assert not again.seen(f"c{PREFIX + 21}.0")
    old = PushRecord.from_state(["c1.0", "u2"])  # checkpoints before the record had marks
    assert old.seen("c1.0") and old.seen("u2") and len(old) == 2


def test_the_store_applies_each_closure_push_once_and_refuses_late_copies():
    store = VariableStore()
    spec = ShardSpec("w", 0, 1, (2,), (2,), 0, "float32", OptimizerConfig("sgd", 1.0))
    store.create(spec, np.zeros(2, np.float32))
    grad = np.ones(2, np.float32)
    first = store.push(f"c{PREFIX + 1}.0", [PushItem(("w", 0), grad)], final_below=PREFIX + 1)
    again = store.push(f"c{PREFIX + 1}.0", [PushItem(("w", 0), grad)], final_below=PREFIX + 1)
    assert [r.applied for r in first + again] == [True, False]
    store.push(f"c{PREFIX + 2}.0", [PushItem(("w", 0), grad)], final_below=PREFIX + 2)
    late = store.push(f"c{PREFIX + 1}.1", [PushItem(("w", 0), grad)])  # closure 1 is final now
    assert not late[0].applied and late[0].version == 2
    np.testing.assert_array_equal(store.get(("w", 0)).value, [-2, -2])
    assert len(store.get(("w", 0)).record) == 1


@pytest.mark.parametrize("n", [0, 1])
def test_a_mark_of_zero_changes_nothing(n):
    record = PushRecord()
    record.add(f"c{PREFIX}.{n}")
    record.advance(0)
    assert record.seen(f"c{PREFIX}.{n}") and len(record) == 1
