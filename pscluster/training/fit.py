"""`fit`: Keras's epoch loop on schedule/join, with callbacks, validation, History and resume.

    history = fit(coord, train_step, coord.create_per_worker_dataset(make_batches), epochs=12,
                  steps_per_epoch=62, learning_rate=1e-3, validation=evaluate,
                  callbacks=[LearningRateScheduler(decay), BackupAndRestore("backup")])

Each epoch schedules `steps_per_epoch` closures `train_step(iterator)` (as TF's ParameterServerStrategy
does: steps_per_epoch is required, the per-worker iterators run on across epochs), shows a progress bar,
calls `on_train_batch_end` with each closure's returned logs in scheduling order, joins, runs
`validation()` on the driver (its names get a `val_` prefix), and calls `on_epoch_end` with the epoch's
means. Nothing is kept on the workers beyond what a hand-written schedule/join loop keeps: the
closures are the user's step function, unchanged. The framework adapters (`pscluster.torch.fit`,
`pscluster.jax.fit`) build `train_step` and `validation` from a model and a loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.training.backup import BackupAndRestore
from pscluster.training.callbacks import Callback, CallbackList
from pscluster.training.history import History
from pscluster.training.progress import EpochBar

StepFn = Callable[[Any], Any]
Validation = Callable[[], Mapping[str, float]]


def set_learning_rate(coord: Any, lr: float, variables: Sequence[Any] | None = None) -> None:
    """The one place fit changes the PS learning rate: `coord.set_learning_rate` (from the next update on every
    shard, checkpointed with the shards).

    Raises:
        FailedPreconditionError: the coordinator cannot change learning rates.
    """
    setter = getattr(coord, "set_learning_rate", None)
    if setter is None:
        raise FailedPreconditionError(f"{type(coord).__name__} has no set_learning_rate: this pscluster cannot "
                                      "change the PS learning rate during training")
    setter(lr, variables=variables)


class FitModel:
    """What callbacks see as `self.model`: the PS learning rate, stop_training, save_weights."""

    def __init__(self, coord: Any, learning_rate: float, variables: Sequence[Any] | None = None,
                 set_lr: Callable[[Any, float, Sequence[Any] | None], None] = set_learning_rate) -> None:
        self.coord = coord
        self.variables = variables
        self.stop_training = False
        self._lr = float(learning_rate)
        self._set_lr = set_lr

    @property
    def learning_rate(self) -> float:
        """The learning rate the PS tasks apply (as last set through this model)."""
        return self._lr

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise InvalidArgumentError(f"learning_rate={lr!r}: must be a finite number >= 0")
        if float(lr) != self._lr:
            self._set_lr(self.coord, float(lr), self.variables)
        self._lr = float(lr)

    def save_weights(self, path: str) -> None:
        """Every variable, whole, to one safetensors file (readable without pscluster)."""
        self.coord.client.export(path)


def step_logs(value: Any) -> dict[str, float]:
    """A closure's result as logs: a mapping of names to numbers, or one number (the loss).

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(value, Mapping):
        try:
            return {str(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            pass
    elif isinstance(value, (int, float)):
        return {"loss": float(value)}
    raise InvalidArgumentError(f"fit: a training step returned {value!r}; return a dict of numbers "
                               "(e.g. {'loss': loss.item()}) or one number (the loss)")


class _Means:
    """Running means of the logs of an epoch's closures."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[float, int]] = {}

    def add(self, logs: Mapping[str, float]) -> None:
        for name, value in logs.items():
            total, n = self.sums.get(name, (0.0, 0))
            self.sums[name] = (total + value, n + 1)

    def means(self) -> dict[str, float]:
        return {name: total / n for name, (total, n) in self.sums.items()}


def completed_closures(global_step: int, mode: str, replicas_to_aggregate: int) -> int:
    """The closures whose updates a restored global step G holds: G in async and bounded mode (every closure's
    report advances G), G x R in sync mode (a step averages R closures' gradients; a closure skipped for a
    non-finite gradient counts toward R, and a step's partial accumulation is not checkpointed, so its closures
    run again). With backup replicas (N > R) a late closure's gradients are dropped: it is not counted.
    """
    if mode == "sync":
        return global_step * max(1, replicas_to_aggregate)
    return global_step


def resume_point(coord: Any, global_step: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, step in epoch) where the closures held by the PS tasks' global step end, in any update mode."""
    if not global_step:
        return 0, 0
    reply = coord.client.sync_step()  # the mode and R the PS tasks restored with their checkpoint
    return divmod(completed_closures(global_step, reply.mode, reply.replicas_to_aggregate), steps_per_epoch)


def past_drawn(coord: Any, dataset: Any, closures: int) -> Any:
    """The dataset a resumed fit draws from: each worker's iterator past its share of the elements the restored
    `closures` drew (one each, as the adapters' steps draw), not from the first element again.

    The rerun's workers build their iterators afresh, so without this the closures after the restored step
    trained on the batches those before it had (a resumed run of examples/tutorial_mnist.py saw about half as
    many distinct batches as a whole one). The share is closures // workers alive: asynchronous workers take
    closures as they free up, so it is off by the difference between the killed run's workers' counts.
    A dataset without `skip` (not a per-worker dataset) is drawn from its start.
    """
    skip = getattr(dataset, "skip", None)
    workers = getattr(coord, "num_workers", None)
    if not closures or skip is None or workers is None:
        return dataset
    return skip(closures // max(1, int(workers())))


def _check(epochs: int, steps_per_epoch: int, initial_epoch: int, verbose: int) -> None:
    if not isinstance(epochs, int) or epochs < 1:
        raise InvalidArgumentError(f"fit: epochs={epochs!r}; must be an int >= 1")
    if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise InvalidArgumentError(f"fit: steps_per_epoch={steps_per_epoch!r} is required (an int >= 1), as with "
                                   "TF's ParameterServerStrategy: per-worker datasets have no end")
    if not 0 <= initial_epoch < epochs:
        raise InvalidArgumentError(f"fit: initial_epoch={initial_epoch}; must be in [0, epochs={epochs})")
    if verbose not in (0, 1, 2):
        raise InvalidArgumentError(f"fit: verbose={verbose!r}; use 0 (silent), 1 (a bar per epoch) or 2 (a line)")


def fit(coord: Any, train_step: StepFn, dataset: Any, *, epochs: int, steps_per_epoch: int,
        learning_rate: float, variables: Sequence[Any] | None = None, callbacks: Iterable[Callback] = (),
        validation: Validation | None = None, initial_epoch: int = 0, verbose: int = 1) -> History:
    """Train for `epochs` epochs of `steps_per_epoch` closures `train_step(iter(dataset))`; returns the History.

    Args:
        coord: a ClusterCoordinator or RemoteCoordinator.
        train_step: the closure body, run on a worker with the worker's iterator; returns a dict of
            scalars ({"loss": ..., "accuracy": ...}) or one number (the loss).
        dataset: a per-worker dataset (coord.create_per_worker_dataset(fn)).
        learning_rate: the learning rate the variables were created with (callbacks read and change it).
        variables: the variables whose learning rate callbacks change (None: every variable).
        validation: called on the driver after each epoch; its values are logged with a val_ prefix.
        initial_epoch: the epoch to start at (a BackupAndRestore among the callbacks overrides it).
        verbose: 0 silent, 1 a progress bar per epoch, 2 one line per epoch.

    Raises:
        InvalidArgumentError: bad arguments, or a step that returns something other than numbers.
        FailedPreconditionError: BackupAndRestore cannot match the restored step (see backup.py).
        Exception: the first error raised inside a closure (as coord.join() raises it).
    """
    _check(epochs, steps_per_epoch, initial_epoch, verbose)
    user = list(callbacks)
    backups = [cb for cb in user if isinstance(cb, BackupAndRestore)]
    if len(backups) > 1:
        raise InvalidArgumentError("fit: more than one BackupAndRestore among the callbacks")
    history = History()
    model = FitModel(coord, learning_rate, variables)
    stateful = [history, *[cb for cb in user if not isinstance(cb, BackupAndRestore)]]
    cbs = CallbackList([*stateful, *backups], model, {"epochs": epochs, "steps": steps_per_epoch,
                                                      "verbose": verbose})
    cbs.on_train_begin()
    epoch, first_step, drawn = initial_epoch, 0, 0
    if backups:
        restored = int(coord.global_step)
        epoch, first_step = resume_point(coord, restored, steps_per_epoch)
        saved = backups[0].saved_epochs()
        if first_step == 0 and 0 < epoch <= epochs and epoch not in saved and epoch - 1 in saved:
            # checkpointed after the epoch's last closure, killed before its callbacks ran: they run now
            epoch, first_step = epoch - 1, steps_per_epoch
        drawn = epoch * steps_per_epoch + first_step
        saved_lr = backups[0].restore(min(epoch, epochs), stateful)
        if saved_lr is not None:
            model.learning_rate = saved_lr
        if epoch or first_step:
            print(f"BackupAndRestore: the PS tasks restored global step {restored} "
                  f"({epoch * steps_per_epoch + first_step} closures): resuming at epoch {epoch + 1}, "
                  f"step {first_step}", flush=True)
    iterator = iter(past_drawn(coord, dataset, drawn))
    while epoch < epochs and not model.stop_training:
        if backups:
            backups[0].save(epoch, model.learning_rate, stateful)
        cbs.on_epoch_begin(epoch)
        bar = EpochBar(epoch, epochs, steps_per_epoch, first_step, verbose)
        logs = _run_epoch(coord, train_step, iterator, cbs, bar, first_step, steps_per_epoch)
        if first_step == steps_per_epoch:  # the epoch's closure logs died with the killed driver
            logs = {name: math.nan for name in history.history if not name.startswith("val_")}
            logs.pop("learning_rate", None)
        if validation is not None:
            logs.update({k if k.startswith("val_") else f"val_{k}": float(v) for k, v in validation().items()})
        logs["learning_rate"] = model.learning_rate
        bar.report(logs)
        cbs.on_epoch_end(epoch, logs)
        epoch, first_step = epoch + 1, 0
    if backups and epoch == epochs:
        backups[0].save(epoch, model.learning_rate, stateful)  # a rerun of a finished run finds it finished
    cbs.on_train_end()
    return history


def _run_epoch(coord: Any, train_step: StepFn, iterator: Any, cbs: CallbackList, bar: EpochBar, first: int,
               steps: int) -> dict[str, float]:
    """Schedule the epoch's closures from step `first`, feed their logs to the callbacks in order, join."""
    values = [coord.schedule(train_step, args=(iterator,)) for _ in range(first, steps)]
    means = _Means()
    try:
        for i, value in enumerate(values):
            while not value.wait(EpochBar.REFRESH_S):
                bar.update(first + i, means.means().get("loss", float("nan")), force=True)
            try:
                result = value.fetch()
            except BaseException:
                coord.join()  # raises the closure's error and clears it from the job, as a hand-written loop sees it
                raise
            batch_logs = step_logs(result)
            means.add(batch_logs)
            cbs.on_train_batch_end(first + i, batch_logs)
            bar.update(first + i + 1, means.means().get("loss", float("nan")))
        coord.join()
        bar.update(steps, means.means().get("loss", float("nan")), force=True)
    finally:
        bar.stop()
    return means.means()
