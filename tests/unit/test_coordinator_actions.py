"""The coordinator loop's handler table covers the scheduler's whole vocabulary; no sockets."""

import typing

from pscluster.coordinator import coordinator
from pscluster.coordinator import scheduler as sch


def test_every_scheduler_action_has_exactly_one_performer():
    assert set(coordinator._PERFORMERS) == set(typing.get_args(sch.Action))
