"""A dynamic table's optimizer update of its touched rows: Adagrad in one compiled pass over each row
(server/table_jit.adagrad_rows), every other optimizer through the PS's row update (server/optimizers).

Why Adagrad apart: the row update gathers the rows and slots into temporaries, runs the optimizer's
numpy kernel over them (six passes, each a temporary) and scatters them back: 2.1 of the 3.9 ms of a
push of 4,096 rows x 64 at 1 M keys here. The compiled pass reads each row and its accumulator once
and writes them back, with the same operations in the same order and dtype (bit-identical rows and
slots: tests/unit/test_table_updates.py compares them with the numpy update).
"""

from __future__ import annotations

import numpy as np
from pscluster.server import optimizers as opt  # _clip_scale: the same clip-norm factor as the numpy update
from pscluster.server import table_kernels as kernels

from pscluster.specs import OptimizerConfig


def apply_rows(cfg: OptimizerConfig, values: np.ndarray, rows: np.ndarray, summed: np.ndarray,
               slots: dict[str, np.ndarray], t: int) -> None:
    """One update of the unique `rows` of values (2-D) with one summed gradient each, as
    server/optimizers.apply_rows does; t is the table's push count."""
    if cfg.kind != "adagrad" or not rows.size:
        opt.apply_rows(cfg, values, rows, summed, slots, t)
        return
    lr, step_cfg = cfg.lr_at(t), cfg.at(t)
    dt = values.dtype.type
    wd = step_cfg.weight_decay
    coupled = wd and not step_cfg.decoupled_weight_decay
    kernels.adagrad_rows(
        values, slots["accumulator"], rows, summed,
        lr=dt(lr / (1 + (t - 1) * step_cfg.lr_decay)), eps=dt(step_cfg.epsilon), eps_in_sqrt=step_cfg.eps_in_sqrt,
        scale=dt(opt._clip_scale(cfg, summed)), clip=dt(step_cfg.clip_value or 0), wd=dt(wd if coupled else 0),
        decay=dt(1 - lr * wd) if wd and not coupled else dt(1))
