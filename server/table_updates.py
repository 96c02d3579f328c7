"""A dynamic table's optimizer update of its touched rows: SGD, Adagrad and Adam in one compiled pass over
each row (server/update_jit.py), every other optimizer through the PS's row update (server/optimizers).

Why compiled: the row update gathers the rows and slots into temporaries, runs the optimizer's numpy
kernel over them (six passes for Adagrad, more for Adam, each a temporary) and scatters them back: 2.1
of the 3.9 ms of an Adagrad push of 4,096 rows x 64 at 1 M keys here. The compiled pass reads each row
and its slots once and writes them back, with the same operations in the same order and dtype
(bit-identical rows and slots: tests/unit/test_table_updates.py compares them with the numpy update).
"""

from __future__ import annotations

import math

import numpy as np
from pscluster.server import optimizers as opt
from pscluster.server import table_kernels as kernels

from pscluster.specs import OptimizerConfig

COMPILED = ("sgd", "adagrad", "adam")


def apply_rows(cfg: OptimizerConfig, values: np.ndarray, rows: np.ndarray, summed: np.ndarray,
               slots: dict[str, np.ndarray], t: int) -> None:
    """One update of the unique `rows` of values (2-D) with one summed gradient each, as
    server/optimizers.apply_rows does; t is the table's push count."""
    if cfg.kind not in COMPILED or not rows.size:
        opt.apply_rows(cfg, values, rows, summed, slots, t)
        return
    lr, step_cfg = cfg.lr_at(t), cfg.at(t)
    dt = values.dtype.type
    wd = step_cfg.weight_decay
    coupled = wd and not step_cfg.decoupled_weight_decay
    # the gradient's preparation in server/optimizers._update: clip-norm factor, clip by value, weight decay
    prep = {"scale": dt(opt.clip_scale(cfg, summed)), "clip": dt(step_cfg.clip_value or 0),
            "wd": dt(wd if coupled else 0), "decay": dt(1 - lr * wd) if wd and not coupled else dt(1)}
    if cfg.kind == "sgd":
        kernels.sgd_rows(values, rows, summed, lr=dt(lr), **prep)
    elif cfg.kind == "adagrad":
        kernels.adagrad_rows(values, slots["accumulator"], rows, summed,
                             lr=dt(lr / (1 + (t - 1) * step_cfg.lr_decay)), eps=dt(step_cfg.epsilon),
                             eps_in_sqrt=step_cfg.eps_in_sqrt, **prep)
    else:  # the scalars of server/optimizer_kernels.adam, computed as it computes them
        b1, b2 = step_cfg.beta1, step_cfg.beta2
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        m = slots["m"]
        kernels.adam_rows(values, m, slots["v"], slots.get("v_max", m), rows, summed, one_b1=dt(1 - b1), b2=dt(b2),
                          one_b2=dt(1 - b2), amsgrad=step_cfg.amsgrad, eps=dt(step_cfg.epsilon),
                          epsilon_hat=step_cfg.epsilon_hat, sqrt_bc2=dt(math.sqrt(bc2)),
                          step_size=dt(lr * math.sqrt(bc2) / bc1 if step_cfg.epsilon_hat else lr / bc1), **prep)
