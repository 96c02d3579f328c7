"""`pscluster evaluator`: TF's side-car evaluator: a user's eval function on the model, beside training.

    pscluster evaluator --cluster cluster.yaml --eval-fn my_eval:evaluate --logdir runs/
    pscluster evaluator --cluster cluster.yaml --eval-fn my_eval:evaluate --from variables --every-s 30

`--eval-fn module:function` names a function taking the model as {variable name: numpy array} and
returning {metric: number}. From `checkpoints` (the default when the cluster has a checkpoint_dir) it
runs once on each new complete checkpoint; from `variables` it pulls every variable every `--every-s`
seconds (read-only pulls: it never pushes, so training only pays for the pulls). Each evaluation is
one log line and one TensorBoard point per metric in `<logdir>/eval`, at the checkpoint's step (or PS
0's global step when pulling).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import pathlib
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pscluster.checkpoint_files import complete_steps, read_variables
from pscluster.client.client import PSClient
from pscluster.config import Settings
from pscluster.errors import ConfigError, PsclusterError

log = logging.getLogger(__name__)
EvalFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float]]


def load_eval_fn(spec: str) -> EvalFn:
    """The function `module:function` names (the working directory is importable, as for `python -m`).

    Raises:
        ConfigError: a malformed spec, a module that does not import, or no such callable.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--eval-fn {spec!r}: expected module:function, e.g. my_eval:evaluate")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises, said in one line
        raise ConfigError(f"--eval-fn {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--eval-fn {spec!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def _metrics(fn: EvalFn, variables: Mapping[str, np.ndarray]) -> dict[str, float]:
    result = fn(variables)
    if not isinstance(result, Mapping):
        raise ConfigError(f"the eval function returned {type(result).__name__}; it must return {{metric: number}}")
    metrics = {str(k): float(v) for k, v in result.items()}
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        log.warning("evaluator: metrics %s are not finite", bad)
    return metrics


class Evaluator:
    """Runs an eval function on checkpoints or pulled variables and writes the metrics (owns its writer)."""

    def __init__(self, settings: Settings, fn: EvalFn, source: str, every_s: float) -> None:
        if source == "checkpoints" and settings.checkpoint_dir is None:
            raise ConfigError("--from checkpoints needs the cluster's checkpoint_dir (--checkpoint-dir); "
                              "or evaluate pulled variables: --from variables")
        self.settings = settings
        self.fn = fn
        self.source = source
        self.every_s = every_s
        self.evaluations = 0
        self._last_step = -1
        self._writer: Any = None
        if settings.logdir is not None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(pathlib.Path(settings.logdir) / "eval"), flush_secs=5)
        self._client = PSClient(settings) if source == "variables" else None

    def run(self, stop: threading.Event) -> None:
        """Evaluate until stop is set (checked every every_s seconds)."""
        while True:
            try:
                self.once()
            except PsclusterError as exc:  # a PS restarting: the next round tries again
                log.warning("evaluator: %s; trying again in %.0f s", exc, self.every_s)
            if stop.wait(self.every_s):
                return

    def once(self) -> dict[str, float] | None:
        """One evaluation if there is something new to evaluate; its metrics, or None."""
        if self.source == "checkpoints":
            assert self.settings.checkpoint_dir is not None
            steps = complete_steps(pathlib.Path(self.settings.checkpoint_dir))
            if not steps or steps[-1][0] <= self._last_step:
                return None
            step, files = steps[-1]
            variables = read_variables(files)
        else:
            assert self._client is not None
            found = self._client.variables()
            names = sorted(n for n, v in found.items() if not v.dynamic)  # a dynamic table has no whole value
            values = self._client.pull([found[n] for n in names]) if names else []
            variables = dict(zip(names, values))
            step = int(self._client.sync_step().global_step)
        metrics = _metrics(self.fn, variables)
        self._last_step = step
        self.evaluations += 1
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        print(f"eval step {step} ({self.source}, {len(variables)} variables): {shown}", flush=True)
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(f"eval/{name}", value, step)
            self._writer.flush()
        return metrics

    def close(self) -> None:
        """Close the event file and the PS connections."""
        if self._writer is not None:
            self._writer.close()
        if self._client is not None:
            self._client.close()


def serve(settings: Settings, eval_fn: str, source: str | None, every_s: float) -> None:
    """The evaluator daemon: evaluate until SIGTERM/SIGINT.

    Raises:
        ConfigError: a bad --eval-fn or source.
    """
    from pscluster.ops import daemon

    fn = load_eval_fn(eval_fn)
    source = source or ("checkpoints" if settings.checkpoint_dir is not None else "variables")
    stop = daemon.stop_on_signals(settings.parent_pid)
    evaluator = Evaluator(settings, fn, source, every_s)
    print(f"READY evaluator ({source}, every {every_s:g} s, eval fn {eval_fn}"
          f"{', logdir ' + str(settings.logdir) if settings.logdir else ''})", flush=True)
    try:
        evaluator.run(stop)
    finally:
        evaluator.close()
