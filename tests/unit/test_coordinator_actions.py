"""The coordinator loop's handler table covers the scheduler's whole vocabulary; no sockets."""

import typing

from pscluster.coordinator import coordinator
from pscluster.coordinator import scheduler as sch


def test_every_scheduler_action_has_exactly_one_performer():
    assert set(coordinator._PERFORMERS) == set(typing.get_args(sch.Action))


def test_a_registration_the_busy_loop_does_not_take_in_time_is_retryable():
    """A worker whose registration times out in the coordinator's inbox retries (it gave up at startup when
    this surfaced as an internal error under load)."""
    import concurrent.futures
    import types

    import pytest

    from pscluster.errors import DeadlineExceededError

    never: concurrent.futures.Future[list[sch.Action]] = concurrent.futures.Future()
    busy = types.SimpleNamespace(settings=types.SimpleNamespace(bulk_transport=False),
                                 _inbox=types.SimpleNamespace(ask=lambda event: never))
    with pytest.raises(DeadlineExceededError, match="worker w0: .*busy") as caught:
        coordinator.ClusterCoordinator.register(busy, "w0", "127.0.0.1:1", timeout=0.01)  # type: ignore[arg-type]
    assert caught.value.retryable
