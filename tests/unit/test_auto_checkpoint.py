"""The automatic checkpoint policy (pure decide) and its executor with a fake save."""

import threading

import pytest
from pscluster.coordinator.checkpoints import (
    AutoCheckpointer,
    PolicyState,
    Refused,
    Save,
    Saved,
    Tick,
    decide,
    needs_step,
)

from pscluster.config import load_settings
from pscluster.errors import ConfigError, FailedPreconditionError, UnavailableError


def test_every_n_steps():
    state = PolicyState(every_steps=10, every_s=None, last_step=0, last_time=0.0)
    assert decide(state, Tick(9), 1.0) == []
    assert decide(state, Tick(10), 1.0) == [Save(10)]
    decide(state, Saved(10), 1.0)
    assert decide(state, Tick(19), 2.0) == [] and decide(state, Tick(25), 2.0) == [Save(25)]


def test_every_t_seconds_only_when_the_step_moved():
    state = PolicyState(every_steps=None, every_s=5.0, last_step=100, last_time=0.0)  # resumed at 100
    assert decide(state, Tick(101), 4.9) == []
    assert decide(state, Tick(101), 5.0) == [Save(101)]
    decide(state, Saved(101), 5.0)
    assert decide(state, Tick(101), 60.0) == []  # no progress: nothing new to save


def test_either_trigger_fires():
    state = PolicyState(every_steps=1000, every_s=5.0, last_step=0, last_time=0.0)
    assert decide(state, Tick(3), 6.0) == [Save(3)]
    decide(state, Saved(3), 6.0)
    assert decide(state, Tick(1003), 6.5) == [Save(1003)]


def test_a_refusal_switches_the_policy_off():
    state = PolicyState(every_steps=1, every_s=None, last_step=0, last_time=0.0)
    decide(state, Refused(), 0.0)
    assert decide(state, Tick(50), 1.0) == [] and not state.enabled


def test_the_step_is_asked_for_only_when_a_save_could_be_due():
    by_time = PolicyState(every_steps=None, every_s=60.0, last_step=0, last_time=100.0)
    assert not needs_step(by_time, 159.9)  # a sync job's step costs RPCs to every PS: not asked every tick
    assert needs_step(by_time, 160.0)
    by_steps = PolicyState(every_steps=10, every_s=None, last_step=0, last_time=100.0)
    assert needs_step(by_steps, 100.0)
    decide(by_steps, Refused(), 100.0)
    assert not needs_step(by_steps, 1000.0)


class FakeCluster:
    def __init__(self, fail_first=None):
        self.step = 0
        self.saves = []
        self.fail_first = fail_first
        self.saved = threading.Event()

    def save(self, step):
        if self.fail_first is not None:
            exc, self.fail_first = self.fail_first, None
            raise exc
        self.saves.append(step)
        self.saved.set()


def run(cluster, state):
    errors = []
    ckpt = AutoCheckpointer(state, step=lambda: cluster.step, save=cluster.save, clock=lambda: 0.0,
                            on_fatal=errors.append, poll_s=0.001).start()
    return ckpt, errors


def test_executor_saves_retries_a_failed_save_and_stops():
    cluster = FakeCluster(fail_first=UnavailableError("ps 1 down"))
    cluster.step = 20
    ckpt, errors = run(cluster, PolicyState(every_steps=10, every_s=None, last_step=0, last_time=0.0))
    assert cluster.saved.wait(10)
    ckpt.stop()
    assert cluster.saves == [20] and ckpt.saved_step == 20 and errors == []


def test_executor_turns_off_without_a_checkpoint_directory():
    cluster = FakeCluster(fail_first=FailedPreconditionError("ps 0 has no checkpoint_dir"))
    cluster.step = 20
    ckpt, errors = run(cluster, PolicyState(every_steps=10, every_s=None, last_step=0, last_time=0.0))
    ckpt._thread.join(timeout=10)  # the thread ends by itself once the policy is off
    assert not ckpt._thread.is_alive()
    ckpt.stop()
    assert cluster.saves == [] and not ckpt.state.enabled and errors == []


def test_settings_and_environment():
    spec = {"ps": ["127.0.0.1:1"], "worker": []}
    s = load_settings(env={}, overrides={"cluster": spec})
    assert (s.auto_checkpoint, s.checkpoint_every_steps, s.checkpoint_every_s) == (True, None, 60.0)
    s = load_settings(env={"PSCLUSTER_CHECKPOINT_EVERY_STEPS": "500", "PSCLUSTER_CHECKPOINT_EVERY_S": "5",
                           "PSCLUSTER_AUTO_CHECKPOINT": "false"}, overrides={"cluster": spec})
    assert (s.auto_checkpoint, s.checkpoint_every_steps, s.checkpoint_every_s) == (False, 500, 5.0)
    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        load_settings(env={"PSCLUSTER_CHECKPOINT_EVERY_STEPS": "0"}, overrides={"cluster": spec})
