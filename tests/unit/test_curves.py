"""Training curves: interval means of reported scalars and closures/s, read back from the event files."""

import pytest
from pscluster.coordinator.curves import TrainingCurves

from pscluster.client import context
from pscluster.errors import InvalidArgumentError
from tests.events import scalars


def test_reported_scalars_become_interval_means_at_the_closure_count(tmp_path):
    curves = TrainingCurves(tmp_path, interval_s=3600)  # written at stop(): one point
    for i in range(100):
        curves.add({"loss": float(i), "acc": 0.5} if i % 2 else {"loss": float(i)})
    curves.stop()
    got = scalars(tmp_path / "train")
    assert got["train/loss"] == [(100, pytest.approx(49.5))]
    assert got["train/acc"] == [(100, pytest.approx(0.5))]
    assert got["train/closures_per_s"][0][0] == 100 and got["train/closures_per_s"][0][1] > 0


def test_report_keeps_the_mean_per_closure_and_refuses_non_numbers():
    scope = context.ClosureScope(7, client=None)
    with scope:
        context.report(loss=2.0)
        context.report(loss=4.0, lr=0.1)
        with pytest.raises(InvalidArgumentError, match="not a finite number"):
            context.report(loss=float("nan"))
        with pytest.raises(InvalidArgumentError, match="is not a number"):
            context.report(loss="high")
    assert scope.scalars == {"loss": (6.0, 2), "lr": (0.1, 1)}
    context.report(loss=1.0)  # outside a closure: ignored


def test_driver_set_hyperparameters_are_written_from_their_change_on(tmp_path):
    curves = TrainingCurves(tmp_path, interval_s=3600)
    for _ in range(10):
        curves.add({})
    curves.hyperparameters({"learning_rate": 0.05})
    curves.stop()
    assert scalars(tmp_path / "train")["hparams/learning_rate"] == [(10, pytest.approx(0.05))]
