"""The framed dispatcher's bookkeeping of connections and attempts; no sockets, no threads."""

from dataclasses import dataclass

from pscluster.coordinator.attempts import Attempts


@dataclass(eq=False)
class Conn:
    wid: str
    pending: tuple[int, str] | None = None
    abandoned: bool = False


def test_a_new_worker_has_no_idle_connection_and_an_answered_one_is_reused():
    table = Attempts()
    assert table.reuse("w") is None
    conn = Conn("w")
    table.carry((1, "w"), conn)
    assert table.answered(conn) == (1, "w") and conn.pending is None
    assert table.reuse("w") is conn
    assert table.reuse("w") is None  # one attempt per connection: it is busy again


def test_a_broken_connection_fails_its_attempt_and_is_never_reused():
    table = Attempts()
    table.reuse("w")
    conn = Conn("w")
    table.carry((1, "w"), conn)
    assert table.broke(conn) == (1, "w")
    assert table.reuse("w") is None


def test_an_idle_connection_that_breaks_fails_nothing_and_leaves_the_idle_list():
    table = Attempts()
    table.reuse("w")
    conn = Conn("w")
    table.carry((1, "w"), conn)
    table.answered(conn)
    assert table.broke(conn) is None  # the worker closed an idle connection
    assert table.reuse("w") is None


def test_an_abandoned_attempts_answer_and_failure_reach_nobody_and_its_connection_is_not_parked():
    table = Attempts()
    table.reuse("w")
    conn = Conn("w")
    table.carry((1, "w"), conn)
    assert table.abandon((1, "w")) is conn and conn.abandoned
    assert table.abandon((1, "w")) is None  # twice: nothing left to shut down
    assert table.answered(conn) is None
    assert table.reuse("w") is None
    assert table.broke(conn) is None


def test_a_forgotten_worker_stays_forgotten():
    table = Attempts()
    table.reuse("w")
    idle, busy = Conn("w"), Conn("w")
    table.carry((1, "w"), idle)
    table.answered(idle)
    table.carry((2, "w"), busy)
    assert table.forget("w") == [idle] and idle.abandoned
    assert table.answered(busy) == (2, "w")  # its attempt is still answered...
    assert table.forget("w") == []  # ...but the connection is not parked under a worker that is gone
    assert table.broke(idle) is None


def test_clear_hands_back_every_connection_marked_abandoned():
    table = Attempts()
    table.reuse("a")
    idle, busy = Conn("a"), Conn("b")
    table.carry((1, "a"), idle)
    table.answered(idle)
    table.carry((2, "b"), busy)
    assert table.clear() == [idle, busy] and idle.abandoned and busy.abandoned
    assert table.answered(busy) is None and table.abandon((2, "b")) is None
