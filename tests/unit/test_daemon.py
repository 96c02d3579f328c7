"""Start-up waits: backoff, one log line per kind of failure, a timeout, and no wait for a refusal."""

import json
import logging
import sys
import types

import pytest

from pscluster.closures import _is_user_module
from pscluster.errors import DeadlineExceededError, StartupError, UnauthenticatedError, UnavailableError
from pscluster.ops.daemon import Waiter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_waiter_backs_off_and_logs_once_per_kind_of_failure(caplog):
    clock = Clock()
    waiter = Waiter("coordinator", "ps 1 at 127.0.0.1:7002", timeout=30.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="pscluster.ops.daemon"):
        delays = []
        for err in [UnavailableError("down")] * 6 + [DeadlineExceededError("slow")] * 2:
            delays.append(waiter.failed(err))
            clock.now += delays[-1]
        waiter.succeeded()
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waits == ["coordinator: waiting for ps 1 at 127.0.0.1:7002 (UnavailableError); retrying for up to 30 s",
                     "coordinator: waiting for ps 1 at 127.0.0.1:7002 (DeadlineExceededError); retrying for up to 30 s"]
    assert caplog.records[-1].getMessage().startswith("coordinator: ps 1 at 127.0.0.1:7002 is up after 4.5")


def test_waiter_gives_up_after_the_timeout_naming_what_it_waited_for():
    clock = Clock()
    waiter = Waiter("worker w1", "the coordinator at 127.0.0.1:7000", timeout=2.0, clock=clock)
    assert waiter.failed(UnavailableError("refused")) == 0.05
    clock.now += 1.99
    assert waiter.failed(UnavailableError("refused")) == pytest.approx(0.01)  # never sleeps past the timeout
    clock.now += 0.01
    with pytest.raises(StartupError, match=r"^worker w1: gave up after 2 s waiting for the coordinator at "
                                           r"127\.0\.0\.1:7000 \(UnavailableError: refused\)"):
        waiter.failed(UnavailableError("refused"))


def test_waiter_does_not_wait_for_a_refusal():
    waiter = Waiter("coordinator", "ps 0 at 127.0.0.1:7001", timeout=300.0, clock=Clock())
    with pytest.raises(StartupError, match="ps 0 at 127.0.0.1:7001 refused us \\(UnauthenticatedError"):
        waiter.failed(UnauthenticatedError("wrong token"))


def test_user_modules_are_the_ones_neither_stdlib_nor_installed_nor_pscluster(tmp_path):
    (tmp_path / "proj_mod_1c2d.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import proj_mod_1c2d

        assert _is_user_module("proj_mod_1c2d", proj_mod_1c2d)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("proj_mod_1c2d", None)
    import numpy

    import pscluster.closures

    assert not _is_user_module("json", json)
    assert not _is_user_module("numpy", numpy)
    assert not _is_user_module("pscluster.closures", pscluster.closures)
    assert not _is_user_module("dynamic", types.ModuleType("dynamic"))
