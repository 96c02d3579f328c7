"""JAX models on pscluster (`pip install pscluster[jax]`): a pytree of parameters on the PS, `jax.grad` on workers.

    import pscluster.jax as ps_jax
    model = ps_jax.PSParams(coord, params, ps.Adam(1e-3))          # params: any pytree of arrays

    def step(iterator):
        x, y = next(iterator)
        pulled = model.pull()                        # every leaf, one request per PS task
        loss, grads = jax.value_and_grad(loss_fn)(pulled.params, x, y)
        model.push(grads)                            # every gradient, one push id
        return float(loss)

    coord.schedule(step, args=(per_worker_iter,)); coord.join()
    trained = model.state()                          # the pytree, whole, as numpy arrays

Each leaf is a PS variable named by its path in the tree (`dense/w`, `layers/0/b`, ...), so the
partitioners, the PS optimizers and schedules (under optax's names: `adamw`, `warmup_cosine_decay_schedule`,
...), sync and bounded modes and checkpoints apply unchanged. A leaf
named in `sparse=` is a sparse table: `pull(ids={"emb": batch_ids})` pulls only the rows the batch
touches and puts them in the tree in the table's place; `pulled.ids["emb"]` gives each batch id's
row in them, so the model indexes `params["emb"][ids]` and `jax.grad` yields the gradient of just
those rows, which `push` sends. A table far larger than a worker's memory trains this way. The core
never imports jax; only this module does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import tree_util

from pscluster import gradients, jax_optim, optimizers
from pscluster.client import context
from pscluster.client.variables import Variable, check_table_ids, unique_rows
from pscluster.errors import FailedPreconditionError, InvalidArgumentError
from pscluster.jax_optim import (
    adagrad as adagrad,
)
from pscluster.jax_optim import (
    adam as adam,
)
from pscluster.jax_optim import (
    adamw as adamw,
)
from pscluster.jax_optim import (
    constant_schedule as constant_schedule,
)
from pscluster.jax_optim import (
    cosine_decay_schedule as cosine_decay_schedule,
)
from pscluster.jax_optim import (
    exponential_decay as exponential_decay,
)
from pscluster.jax_optim import (
    join_schedules as join_schedules,
)
from pscluster.jax_optim import (
    linear_schedule as linear_schedule,
)
from pscluster.jax_optim import (
    lion as lion,
)
from pscluster.jax_optim import (
    piecewise_constant_schedule as piecewise_constant_schedule,
)
from pscluster.jax_optim import (
    polynomial_schedule as polynomial_schedule,
)
from pscluster.jax_optim import (
    rmsprop as rmsprop,
)
from pscluster.jax_optim import (
    sgd as sgd,
)
from pscluster.jax_optim import (
    sgdr_schedule as sgdr_schedule,
)
from pscluster.jax_optim import (
    warmup_cosine_decay_schedule as warmup_cosine_decay_schedule,
)
from pscluster.jax_optim import (
    warmup_exponential_decay_schedule as warmup_exponential_decay_schedule,
)
from pscluster.optimizers import OptimizerConfig
from pscluster.placement import Partitioner


class Pulled(NamedTuple):
    """What a closure's pull returns."""

    params: Any  # the pytree: dense leaves whole, each sparse leaf as the rows the batch touches
    ids: dict[str, np.ndarray]  # per sparse leaf: each batch id's row in params' leaf (the batch's shape)


def leaf_name(path: tuple[Any, ...]) -> str:
    """A pytree path as a variable name: dict keys, sequence indices and attribute names joined by '/'."""
    parts = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts) or "value"


def _definition(name: str, leaf: Any, sparse: bool, table_init: float, seed: int) -> dict[str, Any]:
    """create_variable's arguments for one leaf (a ShapeDtypeStruct table is initialised on the PS)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        if not sparse:
            raise InvalidArgumentError(f"{name}: only a sparse table may be given as a ShapeDtypeStruct; give "
                                       "other leaves their initial values")
        kind = np.dtype(leaf.dtype).kind
        fields: dict[str, Any] = dict(shape=tuple(leaf.shape), dtype=np.dtype(leaf.dtype), initializer="normal",
                                      init_scale=table_init, seed=seed)
    else:
        arr = np.asarray(leaf)
        kind = arr.dtype.kind
        fields = dict(initial_value=arr)
    if kind not in "iuf":
        raise InvalidArgumentError(f"{name}: dtype {np.dtype(leaf.dtype)} has no PS equivalent; use a float or "
                                   "integer dtype")
    if sparse and len(leaf.shape) < 1:
        raise InvalidArgumentError(f"{name}: a sparse table needs at least one axis, got a scalar")
    return fields


class PSParams:
    """A pytree of parameters trained on the PS tasks: pull() in a closure, push(grads) after jax.grad."""

    def __init__(self, coord: Any, params: Any, optimizer: OptimizerConfig | None = None, *,
                 sparse: Iterable[str] = (), partitioner: Partitioner | None = None, prefix: str = "",
                 table_init: float = 1.0, seed: int = 0, nonfinite: str | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
        """Create one variable per leaf (idempotent: the same call again reuses them).

        Args:
            coord: a ClusterCoordinator, RemoteCoordinator or PSClient (anything with create_variable).
            params: the initial parameters, any pytree of arrays (jax or numpy); a sparse table may be a
                `jax.ShapeDtypeStruct`: then the PS initialises it, N(0, table_init**2) seeded by `seed`
                and the shard, and the driver never holds the table.
            optimizer: the PS optimizer of every leaf (`adam`, `adamw`, ... under optax's names, or any
                pscluster optimizer); default SGD(1e-3).
            sparse: names of leaves (see leaf_name) that are embedding tables, pulled and pushed by rows.
            partitioner: applied to every leaf with at least one axis.
            prefix: prepended to every variable name (two models on one cluster).
            nonfinite: what push() does with a gradient holding NaN or Inf, checked on the worker before
                anything is sent: "reject" raises NonFiniteGradientError naming the leaves, "skip" skips
                the step (and counts it), "allow" sends it; default: the client's ("reject").
            max_norm, norm_type: clip all gradients (tables' rows included) to this global norm before
                the push, as optax.clip_by_global_norm (norm_type 2) and torch's clip_grad_norm_.

        Raises:
            InvalidArgumentError: a non-numeric leaf, two leaves with one name, an unknown or scalar table,
                an unknown nonfinite policy, a bad max_norm or norm_type.
            AlreadyExistsError: a variable of the same name exists with another shape or dtype.
        """
        optimizer = optimizer or optimizers.SGD(1e-3)
        gradients.check_policy(nonfinite or "reject", max_norm, norm_type)
        self.nonfinite, self.max_norm, self.norm_type = nonfinite, max_norm, norm_type
        self.optimizer = optimizer
        flat, self.treedef = tree_util.tree_flatten_with_path(params)
        self.names = [leaf_name(path) for path, _ in flat]
        duplicated = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicated:
            raise InvalidArgumentError(f"leaves {duplicated} have the same name; give them distinct keys")
        self.sparse = tuple(sparse)
        unknown = sorted(set(self.sparse) - set(self.names))
        if unknown:
            raise InvalidArgumentError(f"sparse={unknown}: no such leaf; leaves are {self.names}")
        # every leaf is checked before the first variable is created: bad input creates nothing
        definitions = [(name, leaf, _definition(name, leaf, name in self.sparse, table_init, seed))
                       for name, (_, leaf) in zip(self.names, flat)]
        self.prefix = prefix
        self.variables: dict[str, Variable] = {
            name: coord.create_variable(prefix + name, optimizer=optimizer, sparse=name in self.sparse,
                                        partitioner=partitioner if len(np.shape(leaf)) >= 1 else None, **fields)
            for name, leaf, fields in definitions}
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    # -- worker side ------------------------------------------------------------------------------
    def pull(self, ids: Mapping[str, Any] | None = None) -> Pulled:
        """Every dense leaf, and for each sparse table the rows `ids[name]` touches; one request per PS task.

        Raises:
            InvalidArgumentError: ids for a leaf that is not a sparse table, a table without ids,
                non-integer or out-of-range ids.
        """
        ids = dict(ids or {})
        check_table_ids(self.sparse, list(ids))
        dense, rows, leaves, positions, wanted = [], [], {}, {}, {}
        for name in self.names:
            var = self.variables[name]
            if name in ids:
                batch = np.asarray(ids[name])
                wanted[name] = unique_rows(name, batch, var.shape[0])
                positions[name] = np.searchsorted(wanted[name], batch.astype(np.int64, copy=False))
                leaves[name] = np.empty((wanted[name].size,) + var.shape[1:], var.dtype)
                rows.append((var, wanted[name], leaves[name]))
            else:
                leaves[name] = np.empty(var.shape, var.dtype)
                dense.append((var, leaves[name]))
        context.current_client().pull_into(dense, rows)
        self._local.wanted = wanted  # push sends the gradients of exactly these rows
        params = tree_util.tree_unflatten(self.treedef, [jax.numpy.asarray(leaves[n]) for n in self.names])
        return Pulled(params, positions)

    def push(self, grads: Any) -> list[int]:
        """Push a gradient pytree shaped like `pull().params` under one push id (one request per PS task);
        the new shard versions, [] when the step was skipped for a NaN or Inf under nonfinite="skip".

        Gradients are clipped (max_norm) and checked for NaN and Inf before anything is sent: under
        "reject" a bad one raises NonFiniteGradientError and no PS applies any part of the step.

        Raises:
            InvalidArgumentError: grads with another structure, or push() before pull() in this closure.
            NonFiniteGradientError: a gradient holding NaN or Inf under nonfinite="reject".
        """
        leaves, treedef = tree_util.tree_flatten(grads)
        if treedef != self.treedef:  # type: ignore[operator]  # PyTreeDef compares by structure
            raise InvalidArgumentError(f"push: gradients have structure {treedef}, the parameters {self.treedef}")
        wanted: dict[str, np.ndarray] | None = getattr(self._local, "wanted", None)
        if wanted is None and self.sparse:
            raise InvalidArgumentError("push() before pull(): pull the parameters in the same closure first")
        dense, rows = [], []
        for name, grad in zip(self.names, leaves):
            var = self.variables[name]
            arr = np.asarray(grad, dtype=var.dtype)
            if name in self.sparse:
                rows.append((var, wanted[name], arr))  # type: ignore[index]
            else:
                dense.append((var, arr))
        return context.current_client().push(dense, rows=rows, nonfinite=self.nonfinite, max_norm=self.max_norm,
                                             norm_type=self.norm_type)

    # -- driver side ------------------------------------------------------------------------------
    def state(self) -> Any:
        """The trained parameters, whole (tables included), as a pytree of numpy arrays."""
        values = context.current_client().pull([self.variables[n] for n in self.names])
        return tree_util.tree_unflatten(self.treedef, values)


class DynamicRows:
    """A dynamic table (create_variable(shape=(None, dim), sparse=True)) for a jax step over raw int64 ids.

        rows, local = table_rows.pull(batch_ids)     # rows of the batch's unique keys; local: ids -> rows
        g = jax.grad(lambda r: loss(r[local], y))(rows)
        table_rows.push(g)                           # one row push of exactly those keys
    """

    def __init__(self, table: Variable) -> None:
        if not isinstance(table, Variable) or not table.dynamic:
            raise InvalidArgumentError(f"DynamicRows needs a dynamic table (shape=(None, dim), sparse=True), "
                                       f"got {table!r:.80}")
        self.table = table
        self._local = threading.local()  # this thread's last pull (a worker runs closures at once)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def pull(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the unique keys in ids, each id's row index in them, shaped as ids)."""
        arr = np.asarray(ids)
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{self.table.name}: ids must be integers, got {arr.dtype}")
        keys, inverse = np.unique(arr.astype(np.int64, copy=False).reshape(-1), return_inverse=True)
        self._local.keys = keys
        return self.table.pull_rows(keys), inverse.reshape(arr.shape)

    def push(self, grad_rows: Any) -> list[int]:
        """Push the gradient of the rows this thread's last pull returned (same order); the shards' versions."""
        grads = np.asarray(grad_rows)
        keys: np.ndarray | None = getattr(self._local, "keys", None)
        if keys is None:
            raise FailedPreconditionError(f"{self.table.name}: push() needs a pull first (on the same thread)")
        if grads.shape[:1] != keys.shape:
            raise InvalidArgumentError(f"{self.table.name}: {grads.shape[0] if grads.ndim else 0} gradient rows for "
                                       f"the {keys.size} keys of the last pull")
        self._local.keys = None
        return self.table.push_rows(keys, grads)


def fit(coord: Any, model: PSParams, loss_fn: Callable[[Any, Any, Any], Any], dataset: Any, *, epochs: int,
        steps_per_epoch: int, validation_data: tuple[Any, Any] | None = None,
        metrics: Mapping[str, Callable[[Any, Any, Any], Any]] | None = None, callbacks: Iterable[Any] = (),
        initial_epoch: int = 0, verbose: int = 1) -> Any:
    """Keras's fit for a PSParams (see pscluster.training.fit): each closure pulls, takes
    jax.value_and_grad(loss_fn)(params, x, y) on one (x, y) minibatch of the worker's iterator and pushes;
    validation (the loss and `metrics`, each fn(params, x, y)) runs on the driver on the PS's values.
    Returns the History."""
    from pscluster.training import fit as fit_loop

    def train_step(iterator: Any) -> dict[str, float]:
        x, y = next(iterator)
        loss, grads = jax.value_and_grad(loss_fn)(model.pull().params, x, y)
        model.push(grads)
        logs = {"loss": float(loss)}
        context.report(**logs)
        return logs

    validation = None
    if validation_data is not None:
        x_val, y_val = validation_data

        def validation() -> dict[str, float]:
            params = model.state()
            out = {"loss": float(loss_fn(params, x_val, y_val))}
            out.update({name: float(fn(params, x_val, y_val)) for name, fn in (metrics or {}).items()})
            return out

    return fit_loop(coord, train_step, dataset, epochs=epochs, steps_per_epoch=steps_per_epoch,
                    learning_rate=model.optimizer.learning_rate, variables=[model.prefix + n for n in model.names],
                    callbacks=callbacks, validation=validation, initial_epoch=initial_epoch, verbose=verbose)


def SGD(learning_rate: float = 1e-3) -> OptimizerConfig:  # noqa: N802 - optax's names, capitalised as before
    """optax.sgd without momentum, run on the PS (see also `sgd`)."""
    return jax_optim.sgd(learning_rate)


def Adam(learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> OptimizerConfig:  # noqa: N802
    """optax.adam's names and defaults, run on the PS (lazy on sparse tables; see also `adam`)."""
    return jax_optim.adam(learning_rate, b1, b2, eps)
