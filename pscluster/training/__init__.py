"""Keras's `model.fit` on pscluster: an epoch loop on schedule/join with Keras's callbacks, run on the driver.

    from pscluster.training import fit, LearningRateScheduler, BackupAndRestore, TensorBoard
    history = fit(coord, train_step, per_worker_dataset, epochs=12, steps_per_epoch=62, learning_rate=1e-3,
                  callbacks=[LearningRateScheduler(decay), BackupAndRestore("backup"), TensorBoard("logs")])

`pscluster.torch.fit(model, loss_fn, ...)` and `pscluster.jax.fit(...)` build the training step and the
validation from a model; this package is framework-free.
"""

from pscluster.training.backup import BackupAndRestore
from pscluster.training.callbacks import (
                                          Callback,
                                          CallbackList,
                                          EarlyStopping,
                                          LearningRateScheduler,
                                          ReduceLROnPlateau,
                                          TrainingModel,
)
from pscluster.training.fit import FitModel, fit, set_learning_rate, step_logs
from pscluster.training.history import History
from pscluster.training.writers import CSVLogger, ModelCheckpoint, TensorBoard

__all__ = ["BackupAndRestore", "CSVLogger", "Callback", "CallbackList", "EarlyStopping", "FitModel", "History",
           "LearningRateScheduler", "ModelCheckpoint", "ReduceLROnPlateau", "TensorBoard", "TrainingModel", "fit",
           "set_learning_rate", "step_logs"]
