"""fit's epoch loop and Keras's callbacks on the driver, against a coordinator that runs closures in place.

The fake implements the part of the coordinator API fit uses (schedule, join, global_step,
set_learning_rate, client.export); the cluster test of examples/tutorial_mnist.py runs the same loop on
real daemons.
"""

import csv
import itertools
import math
import types

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pscluster.client.context import ClosureScope
from pscluster.client.datasets import PerWorkerDataset, WorkerDatasets, WorkerInfo
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.training import (
    BackupAndRestore,
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TensorBoard,
    fit,
)
from pscluster.training.fit import completed_closures
from tests.events import scalars


class Value:
    def __init__(self, result=None, error=None):
        self.result, self.error = result, error

    def wait(self, timeout=None):
        return True

    def fetch(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.result


class InPlaceCoordinator:
    """Runs each scheduled closure at once; global_step counts closures, as an async coordinator's does
    (mode="sync": steps of `replicas` closures, as the PS tasks count them in sync mode)."""

    def __init__(self, global_step=0, mode="async", replicas=1):
        self.mode, self.replicas = mode, replicas
        self.closures = global_step * (replicas if mode == "sync" else 1)
        self.scheduled = 0
        self.lrs = []
        self.client = self
        self._error = None

    def schedule(self, fn, args=(), kwargs=None):
        self.scheduled += 1
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - kept for join(), as the coordinator does
            self._error = self._error or exc
            return Value(error=exc)
        self.closures += 1
        return Value(result)

    @property
    def global_step(self):
        return self.closures // self.replicas if self.mode == "sync" else self.closures

    def sync_step(self):
        return types.SimpleNamespace(global_step=self.global_step, mode=self.mode,
                                     replicas_to_aggregate=self.replicas)

    def join(self, timeout=None):
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def set_learning_rate(self, lr, variables=None):
        self.lrs.append((lr, variables))

    def export(self, path):
        save_file({"step": np.array([self.global_step], np.int64)}, path)


def counting_step(iterator):
    i = next(iterator)
    return {"loss": 1.0 / (1 + i), "accuracy": i / 100}


class Recorder(Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch", batch, logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


def test_fit_runs_epochs_of_closures_and_logs_their_means_validation_and_lr():
    coord = InPlaceCoordinator()
    rec = Recorder()
    history = fit(coord, counting_step, itertools.count(), epochs=3, steps_per_epoch=4, learning_rate=0.5,
                  validation=lambda: {"loss": 0.25, "val_accuracy": 0.75}, callbacks=[rec], verbose=0)
    assert coord.scheduled == 12
    assert history.epoch == [0, 1, 2]
    assert history.history["loss"] == pytest.approx([np.mean([1 / (1 + i) for i in range(e * 4, e * 4 + 4)])
                                                     for e in range(3)])
    assert history.history["val_loss"] == [0.25] * 3 and history.history["val_accuracy"] == [0.75] * 3
    assert history.history["learning_rate"] == [0.5] * 3
    assert [c[:2] for c in rec.calls[:7]] == [("train_begin",), ("epoch_begin", 0), ("batch", 0), ("batch", 1),
                                              ("batch", 2), ("batch", 3), ("epoch_end", 0)]
    assert rec.calls[2][2] == 1.0 and rec.calls[-1] == ("train_end",)
    assert coord.lrs == []  # nothing changed the learning rate


def test_a_step_that_returns_one_number_logs_it_as_the_loss_and_anything_else_is_refused():
    history = fit(InPlaceCoordinator(), lambda it: 2.0, itertools.count(), epochs=1, steps_per_epoch=2,
                  learning_rate=0.1, verbose=0)
    assert history.history["loss"] == [2.0]
    with pytest.raises(InvalidArgumentError, match="returned 'high'"):
        fit(InPlaceCoordinator(), lambda it: "high", itertools.count(), epochs=1, steps_per_epoch=2,
            learning_rate=0.1, verbose=0)


@pytest.mark.parametrize("kwargs, match", [({"steps_per_epoch": 0}, "steps_per_epoch=0 is required"),
                                           ({"epochs": 0}, "epochs=0"),
                                           ({"initial_epoch": 5}, "initial_epoch=5"),
                                           ({"verbose": 3}, "verbose=3")])
def test_bad_arguments_are_refused_before_any_closure(kwargs, match):
    coord = InPlaceCoordinator()
    args = {"epochs": 2, "steps_per_epoch": 3, "learning_rate": 0.1, "verbose": 0, **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        fit(coord, counting_step, itertools.count(), **args)
    assert coord.scheduled == 0


def test_an_error_inside_a_closure_is_raised_by_fit_and_cleared_from_the_job():
    coord = InPlaceCoordinator()

    def failing(iterator):
        if next(iterator) == 5:
            raise ValueError("bad batch 5")
        return 1.0

    with pytest.raises(ValueError, match="bad batch 5"):
        fit(coord, failing, itertools.count(), epochs=3, steps_per_epoch=4, learning_rate=0.1, verbose=0)
    coord.join()  # cleared: a later join does not raise it again


def test_learning_rate_scheduler_sets_the_ps_rate_at_each_epoch_start_with_one_or_two_argument_schedules():
    coord = InPlaceCoordinator()

    def decay(epoch):  # the tutorial's
        return 1e-3 if epoch < 3 else 1e-4 if epoch < 7 else 1e-5

    history = fit(coord, counting_step, itertools.count(), epochs=8, steps_per_epoch=1, learning_rate=1e-3,
                  variables=["w"], callbacks=[LearningRateScheduler(decay)], verbose=0)
    assert coord.lrs == [(1e-4, ["w"]), (1e-5, ["w"])]  # set only when it changes
    assert history.history["learning_rate"] == [1e-3] * 3 + [1e-4] * 4 + [1e-5]
    coord = InPlaceCoordinator()
    fit(coord, counting_step, itertools.count(), epochs=3, steps_per_epoch=1, learning_rate=1.0,
        callbacks=[LearningRateScheduler(lambda epoch, lr: lr * 0.5)], verbose=0)
    assert [lr for lr, _ in coord.lrs] == [0.5, 0.25, 0.125]
    with pytest.raises(InvalidArgumentError, match="not a finite number"):
        fit(InPlaceCoordinator(), counting_step, itertools.count(), epochs=1, steps_per_epoch=1, learning_rate=1.0,
            callbacks=[LearningRateScheduler(lambda epoch: math.nan)], verbose=0)


def fixed_validation(values):
    it = iter(values)
    return lambda: {"loss": next(it)}


def test_reduce_lr_on_plateau_follows_keras_patience_and_cooldown():
    coord = InPlaceCoordinator()
    val = [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5, 0.5]
    history = fit(coord, counting_step, itertools.count(), epochs=10, steps_per_epoch=1, learning_rate=1.0,
                  validation=fixed_validation(val),
                  callbacks=[ReduceLROnPlateau(factor=0.5, patience=2, cooldown=1, min_lr=0.2)], verbose=0)
    # Keras: wait counts epochs without improvement; at patience the rate drops and cooldown epochs follow
    # (the cooldown epoch itself counts once it ends): waits at 2, 3 -> 0.5; cooldown 4 then a wait; 5 -> 0.25;
    # cooldown 6 then a wait; 7 improves; 8, 9 wait -> 0.125, floored at min_lr 0.2. Logs carry the epoch's rate.
    assert [lr for lr, _ in coord.lrs] == [0.5, 0.25, 0.2]
    assert history.history["learning_rate"] == [1.0] * 4 + [0.5] * 2 + [0.25] * 4
    fit(coord := InPlaceCoordinator(), counting_step, itertools.count(), epochs=8, steps_per_epoch=1,
        learning_rate=1.0, validation=fixed_validation([1.0] * 8),
        callbacks=[ReduceLROnPlateau(factor=0.1, patience=1, min_lr=0.05)], verbose=0)
    assert [lr for lr, _ in coord.lrs] == pytest.approx([0.1, 0.05])  # never below min_lr


def test_early_stopping_stops_after_patience_epochs_without_improvement():
    coord = InPlaceCoordinator()
    stop = EarlyStopping(monitor="val_loss", patience=2, min_delta=0.01)
    history = fit(coord, counting_step, itertools.count(), epochs=10, steps_per_epoch=2, learning_rate=0.1,
                  validation=fixed_validation([1.0, 0.8, 0.795, 0.9, 0.7, 0.7]), callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1, 2, 3] and stop.stopped_epoch == 3 and stop.best == 0.8
    assert coord.scheduled == 8
    with pytest.raises(InvalidArgumentError, match="restore_best_weights"):
        EarlyStopping(restore_best_weights=True)


def test_csv_logger_tensorboard_and_best_only_model_checkpoint_write_their_files(tmp_path):
    coord = InPlaceCoordinator()
    callbacks = [CSVLogger(tmp_path / "log.csv"), TensorBoard(tmp_path / "tb", update_freq=2),
                 ModelCheckpoint(str(tmp_path / "ckpt" / "best_{epoch:02d}_{val_loss:.1f}.safetensors"),
                                 save_best_only=True)]
    fit(coord, counting_step, itertools.count(), epochs=3, steps_per_epoch=4, learning_rate=0.1,
        validation=fixed_validation([0.5, 0.7, 0.3]), callbacks=callbacks, verbose=0)
    rows = read_csv(tmp_path / "log.csv")
    assert rows[0] == ["epoch", "accuracy", "learning_rate", "loss", "val_loss"] and len(rows) == 4
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"] and float(rows[3][4]) == 0.3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best_01_0.5.safetensors",
                                                                     "best_03_0.3.safetensors"]
    assert load_file(tmp_path / "ckpt" / "best_03_0.3.safetensors")["step"][0] == 12
    train, valid = scalars(tmp_path / "tb" / "train"), scalars(tmp_path / "tb" / "validation")
    assert [s for s, _ in train["epoch_loss"]] == [0, 1, 2] and [v for _, v in valid["epoch_loss"]] == \
        pytest.approx([0.5, 0.7, 0.3])
    assert train["epoch_learning_rate"] == [(0, pytest.approx(0.1)), (1, pytest.approx(0.1)),
                                            (2, pytest.approx(0.1))]
    assert [s for s, _ in train["batch_loss"]] == [1, 3, 5, 7, 9, 11]
    with pytest.raises(InvalidArgumentError, match="must end in .safetensors"):
        ModelCheckpoint(str(tmp_path / "weights.h5"))


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


class Crash(Exception):
    pass


def crash_at(step):
    def train_step(iterator):
        i = next(iterator)
        if i == step:
            raise Crash(f"killed at step {i}")
        return {"loss": 1.0 / (1 + i)}
    return train_step


def make_callbacks(tmp_path):
    return [ReduceLROnPlateau(factor=0.5, patience=1), EarlyStopping(patience=5), CSVLogger(tmp_path / "log.csv"),
            BackupAndRestore(tmp_path / "backup")]


def test_backup_and_restore_resumes_at_the_restored_step_with_the_callbacks_state(tmp_path):
    val = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]
    coord = InPlaceCoordinator()
    with pytest.raises(Crash):  # the program dies in epoch 3 (0-based 2), after step 2 * 4 + 2 = 10
        fit(coord, crash_at(10), itertools.count(), epochs=6, steps_per_epoch=4, learning_rate=1.0,
            validation=fixed_validation(val), callbacks=make_callbacks(tmp_path), verbose=0)
    assert [lr for lr, _ in coord.lrs] == [0.5]  # reduced at the end of epoch 1
    # the rerun: the PS tasks restored an automatic checkpoint taken at global step 9
    again = InPlaceCoordinator(global_step=9)
    callbacks = make_callbacks(tmp_path)
    history = fit(again, crash_at(-1), itertools.count(9), epochs=6, steps_per_epoch=4, learning_rate=1.0,
                  validation=fixed_validation(val[2:]), callbacks=callbacks, verbose=0)
    assert again.scheduled == 3 + 3 * 4  # the rest of epoch 2, then epochs 3-5
    assert history.epoch == [0, 1, 2, 3, 4, 5]
    assert history.history["loss"][2] == pytest.approx(np.mean([1 / (1 + i) for i in (9, 10, 11)]))
    # the restored ReduceLROnPlateau's best (1.0) carries on: epoch 2's 1.0 is no improvement (a fresh one
    # would take it as its first best), so the rate drops at its end
    assert [lr for lr, _ in again.lrs] == [0.5, 0.25, 0.125, 0.0625]  # 0.5: the restored rate set on the PS again
    assert history.history["learning_rate"] == [1.0, 1.0, 0.5, 0.25, 0.25, 0.125]
    rows = read_csv(tmp_path / "log.csv")
    assert [r[0] for r in rows[1:]] == ["0", "1", "2", "3", "4", "5"]
    # a rerun of the finished run schedules nothing and returns its history
    done = InPlaceCoordinator(global_step=24)
    history = fit(done, crash_at(-1), itertools.count(), epochs=6, steps_per_epoch=4, learning_rate=1.0,
                  validation=fixed_validation([]), callbacks=make_callbacks(tmp_path), verbose=0)
    assert done.scheduled == 0 and history.epoch == [0, 1, 2, 3, 4, 5]


def test_backup_and_restore_refuses_a_checkpoint_older_than_its_states_or_other_callbacks(tmp_path):
    fit(InPlaceCoordinator(), crash_at(-1), itertools.count(), epochs=8, steps_per_epoch=1, learning_rate=1.0,
        validation=fixed_validation([1.0] * 8), callbacks=[BackupAndRestore(tmp_path, keep=2)], verbose=0)
    assert BackupAndRestore(tmp_path).saved_epochs() == [7, 8]
    with pytest.raises(FailedPreconditionError, match="restored a step in epoch 3"):
        fit(InPlaceCoordinator(global_step=3), crash_at(-1), itertools.count(), epochs=8, steps_per_epoch=1,
            learning_rate=1.0, callbacks=[BackupAndRestore(tmp_path)], verbose=0)
    with pytest.raises(FailedPreconditionError, match="had callbacks"):
        fit(InPlaceCoordinator(global_step=7), crash_at(-1), itertools.count(), epochs=8, steps_per_epoch=1,
            learning_rate=1.0, callbacks=[EarlyStopping(), BackupAndRestore(tmp_path)], verbose=0)


def test_verbose_fit_draws_a_bar_per_epoch_and_prints_each_epoch_line(capsys):
    fit(InPlaceCoordinator(), counting_step, itertools.count(), epochs=2, steps_per_epoch=3, learning_rate=0.1,
        validation=lambda: {"accuracy": 0.5}, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "3/3" in out
    assert "Epoch 2/2: loss: " in out and "val_accuracy: 0.5 - learning_rate: 0.1" in out


@pytest.mark.parametrize("mode", ["sync", "bounded"])
def test_backup_and_restore_resumes_at_the_exact_closure_in_sync_and_bounded_mode(tmp_path, mode):
    replicas = 2 if mode == "sync" else 1
    coord = InPlaceCoordinator(mode=mode, replicas=replicas)
    with pytest.raises(Crash):  # dies in epoch 2 (0-based), at its closure 11
        fit(coord, crash_at(11), itertools.count(), epochs=5, steps_per_epoch=4, learning_rate=1.0,
            validation=fixed_validation([1.0] * 5), callbacks=make_callbacks(tmp_path), verbose=0)
    # the PS tasks restored a checkpoint holding 10 closures: sync step 5 of R = 2, or bounded step 10
    again = InPlaceCoordinator(global_step=10 // replicas, mode=mode, replicas=replicas)
    history = fit(again, crash_at(-1), itertools.count(10), epochs=5, steps_per_epoch=4, learning_rate=1.0,
                  validation=fixed_validation([1.0] * 3), callbacks=make_callbacks(tmp_path), verbose=0)
    assert again.scheduled == 2 + 2 * 4 and again.closures == 5 * 4  # the rest of epoch 2, then epochs 3-4
    assert history.history["loss"][2] == pytest.approx(np.mean([1 / (1 + i) for i in (10, 11)]))


def test_completed_closures_counts_r_per_sync_step_and_one_per_step_otherwise():
    assert completed_closures(7, "sync", 3) == 21
    assert completed_closures(7, "bounded", 3) == completed_closures(7, "async", 1) == 7
    assert completed_closures(0, "sync", 4) == 0


def test_a_checkpoint_taken_after_an_epochs_last_closure_but_before_its_callbacks_resumes_at_that_epochs_end(
        tmp_path):
    coord = InPlaceCoordinator()
    with pytest.raises(Crash):  # killed while epoch 1's validation runs: its closures are all in the checkpoint
        fit(coord, crash_at(-1), itertools.count(), epochs=3, steps_per_epoch=4, learning_rate=1.0,
            validation=crash_at_call(2), callbacks=make_callbacks(tmp_path), verbose=0)
    again = InPlaceCoordinator(global_step=8)
    history = fit(again, crash_at(-1), itertools.count(8), epochs=3, steps_per_epoch=4, learning_rate=1.0,
                  validation=fixed_validation([0.5, 0.5]), callbacks=make_callbacks(tmp_path), verbose=0)
    assert again.scheduled == 4 and history.epoch == [0, 1, 2]  # epoch 1 ends without rerunning a closure
    assert history.history["val_loss"] == [1.0, 0.5, 0.5]
    loss = history.history["loss"]  # epoch 1's closure logs died with the driver
    assert loss[0] == pytest.approx(np.mean([1 / (1 + i) for i in range(4)])) and math.isnan(loss[1])
    assert loss[2] == pytest.approx(np.mean([1 / (1 + i) for i in range(8, 12)]))


def crash_at_call(n):
    calls = itertools.count(1)

    def validation():
        if next(calls) == n:
            raise Crash("killed in validation")
        return {"loss": 1.0}
    return validation


class WorkersCoordinator(InPlaceCoordinator):
    """Closures run in place in turn on `workers` in-process workers, in a closure scope, so a per-worker dataset
    draws as on real workers; each coordinator has fresh workers, as a rerun's new worker processes are."""

    def __init__(self, workers=2, **kwargs):
        super().__init__(**kwargs)
        self.workers = [WorkerDatasets(WorkerInfo(f"w{i}", i)) for i in range(workers)]

    def num_workers(self):
        return len(self.workers)

    def schedule(self, fn, args=(), kwargs=None):
        with ClosureScope(self.scheduled, client=None, worker=self.workers[self.scheduled % len(self.workers)]):
            return super().schedule(fn, args, kwargs)


def test_a_resumed_fit_draws_past_the_batches_the_killed_run_trained_on_not_the_first_ones_again(tmp_path):
    """The rerun's workers build their iterators afresh: without the skip, the closures after the restored step
    trained on the batches those before it had (a resumed examples/tutorial_mnist.py saw fewer distinct batches)."""
    drawn = []

    def train_step(iterator):
        batch = next(iterator)
        if batch == "kill":
            raise Crash("killed")
        drawn.append(batch)
        return {"loss": 1.0}

    def batches(info):  # each worker's endless stream; the program is killed at worker 0's batch 4
        for i in itertools.count():
            yield "kill" if (info.worker_index, i) == (0, 4) and not drawn_again else (info.worker_index, i)

    drawn_again = []
    with pytest.raises(Crash):
        fit(WorkersCoordinator(), train_step, PerWorkerDataset(batches), epochs=3, steps_per_epoch=4,
            learning_rate=1.0, callbacks=[BackupAndRestore(tmp_path / "backup")], verbose=0)
    assert drawn[:8] == [(w, i) for i in range(4) for w in (0, 1)]  # 8 closures, then worker 0's 5th batch kills it
    drawn.clear()
    drawn_again.append(True)
    # the PS tasks restored an automatic checkpoint taken after 6 closures (the 7th and 8th updates are lost)
    again = WorkersCoordinator(global_step=6)
    fit(again, train_step, PerWorkerDataset(batches), epochs=3, steps_per_epoch=4, learning_rate=1.0,
        callbacks=[BackupAndRestore(tmp_path / "backup")], verbose=0)
    assert again.scheduled == 12 - 6
    # each worker starts past its share (6 // 2 = 3) of the batches the restored closures drew
    assert drawn == [(w, i) for i in range(3, 6) for w in (0, 1)]
