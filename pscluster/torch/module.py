"""`PSModule`: a torch.nn.Module whose parameters and buffers live on the PS tasks.

Driver side, `PSModule(coord, net, optimizer)` creates one PS variable per entry of
`net.named_parameters()` (same names, `prefix` prepended) and per persistent buffer; sparse
Embedding/EmbeddingBag weights become sparse tables (see tables.py). Captured in a closure, it
pickles a skeleton of `net` (tables emptied), never the tables.

Worker side, one thread's replica of the module is reused across closures:
`pull(ids=...)` fills every dense parameter and buffer in place (one request per PS task, received
straight into the parameters' memory) and the rows of each table the batch touches; after
`loss.backward()`, `push()` sends every gradient, the tables' touched rows and the buffers' changes
under one push id, one request per PS task.

Buffers (BatchNorm's running statistics and batch count) are PS variables updated by SGD(lr=1.0):
a step pushes `pulled - after_forward` as their gradient, so the PS adds each step's change to its
value. Asynchronously the changes of all workers' batches accumulate (as if one module saw every
batch, in arrival order); in sync mode the replicas' changes of a step are averaged.
"""

from __future__ import annotations

import copy
import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from pscluster import gradients, optimizers
from pscluster.client import context
from pscluster.client.variables import Variable, check_table_ids
from pscluster.errors import InvalidArgumentError
from pscluster.optimizers import OptimizerConfig
from pscluster.placement import Partitioner
from pscluster.torch.optim import ParamGroups
from pscluster.torch.precision import LossScaler, Staging, check_loss_scale, grad_numpy, master_dtype, staged
from pscluster.torch.tables import LocalTable, TableModule, sparse_tables, unique_ids

MAX_MODELS = 16  # models whose replicas a worker keeps (least recently unpickled dropped first)
_serials = itertools.count()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool)


def _numpy(name: str, tensor: torch.Tensor) -> np.ndarray:
    """The initial value of a tensor's PS variable: float32 masters for 16-bit floats."""
    if tensor.dtype not in _DTYPES:
        raise InvalidArgumentError(f"{name}: dtype {tensor.dtype} has no PS equivalent; use bfloat16/float16/32/64 "
                                   "or an integer dtype (cast the module, e.g. net.float())")
    return tensor.detach().to(master_dtype(tensor.dtype)).cpu().numpy()


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A buffer's value as numpy in its master dtype (a copy unless float32/64 on the CPU)."""
    return tensor.detach().to(master_dtype(tensor.dtype)).cpu().numpy()


class _Replicas:
    """Per process: model uid -> its thread-local replicas, so that a PSModule unpickled once per
    closure (passed as an argument) still reuses its replicas. Bounded by MAX_MODELS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_uid: OrderedDict[str, threading.local] = OrderedDict()

    def for_model(self, uid: str) -> threading.local:
        with self._lock:
            local = self._by_uid.get(uid)
            if local is None:
                local = self._by_uid[uid] = threading.local()
                while len(self._by_uid) > MAX_MODELS:
                    self._by_uid.popitem(last=False)
            self._by_uid.move_to_end(uid)
            return local


_REPLICAS = _Replicas()


class _Replica:
    """One thread's copy of the module on a worker, with its tables and the buffers as pulled."""

    def __init__(self, skeleton: nn.Module, names: list[str], tables: Mapping[str, str], buffers: list[str],
                 loss_scale: str | None = None) -> None:
        self.serial = next(_serials)  # tells replicas apart in tests
        self.staging = Staging()
        self.scaler = LossScaler() if loss_scale == "dynamic" else None
        self.module = copy.deepcopy(skeleton)
        # by position: a copy lists its parameters in the original's order, but a Keras 3 model's names
        # (its variables' paths) change when it is copied
        self.params = dict(zip(names, self.module.parameters()))
        self.buffers = {name: self.module.get_buffer(name) for name in buffers}
        self.pulled: dict[str, np.ndarray] = {}
        self.tables = {param: LocalTable(path, cast(TableModule, self.module.get_submodule(path)))
                       for param, path in tables.items()}


class PSModule:
    """A torch.nn.Module trained on the PS tasks: pull() it in a closure, push() its gradients."""

    def __init__(self, coord: Any, module: nn.Module, optimizer: OptimizerConfig | ParamGroups | None = None, *,
                 partitioner: Partitioner | None = None, prefix: str = "", seed: int = 0,
                 table_init: float = 1.0, worker_threads: int | None = 1, nonfinite: str | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, loss_scale: str | None = None) -> None:
        """Create the module's variables on the cluster (idempotent: the same call again reuses them).

        Args:
            coord: a ClusterCoordinator, RemoteCoordinator or PSClient (anything with create_variable).
            module: the model; a sparse table's weight may live on the meta device: then the PS
                initialises it, N(0, table_init**2) seeded by `seed` and the shard (torch's default is
                N(0, 1)), and the driver never holds the table.
            optimizer: the PS optimizer of every parameter (pscluster.torch.SGD/Adam/AdamW/... or
                from_torch(...), whose ParamGroups gives each parameter its group's); default SGD(lr=1e-3).
            partitioner: applied to every parameter with at least one axis (Min/MaxSizePartitioner
                split only the large ones).
            prefix: prepended to every variable name (two models on one cluster).
            worker_threads: torch.set_num_threads on the workers (None leaves torch's default).
            nonfinite: what push() does with a gradient holding NaN or Inf, checked on the worker before
                anything is sent: "reject" raises NonFiniteGradientError naming the parameters, "skip"
                skips the step (and counts it), "allow" sends it; default: the client's ("reject").
            max_norm, norm_type: clip the gradients of all parameters (tables' rows included, buffers
                not) to this global norm before the push, as torch.nn.utils.clip_grad_norm_.
            loss_scale: "dynamic" for float16 modules: backward(loss) scales the loss, push() unscales and
                skips (counts) a step whose gradients are not finite (see precision.py).

        Raises:
            InvalidArgumentError: a dtype without a PS equivalent, or a table with max_norm.
            AlreadyExistsError: a variable of the same name exists with another shape or dtype.
        """
        check_loss_scale(loss_scale)
        self.loss_scale = loss_scale
        chosen = optimizer or optimizers.SGD(1e-3)
        gradients.check_policy(nonfinite or "reject", max_norm, norm_type)
        self.nonfinite, self.max_norm, self.norm_type = nonfinite, max_norm, norm_type
        self.optimizer = chosen
        self.prefix = prefix
        self.worker_threads = worker_threads
        self.tables = sparse_tables(module)
        # state_dict keys in the module's order; a tied tensor's aliases name its one variable
        canonical = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
        self.keys = {key: canonical[id(t)] for key, t in module.state_dict(keep_vars=True).items()}
        self.buffers = [name for name, _ in module.named_buffers() if name in self.keys.values()]
        self.param_names = [name for name, _ in module.named_parameters()]
        # every definition is checked before the first variable is created: bad input creates nothing
        definitions: list[tuple[str, dict[str, Any]]] = []
        for name, param in module.named_parameters():
            param_opt = chosen.for_parameter(param) if isinstance(chosen, ParamGroups) else chosen
            sparse = name in self.tables
            split = partitioner if param.dim() >= 1 else None
            if not param.is_meta:
                definitions.append((name, dict(initial_value=_numpy(name, param), partitioner=split,
                                               optimizer=param_opt, sparse=sparse)))
            elif sparse:
                dtype = _numpy(name, torch.empty(0, dtype=param.dtype)).dtype  # float32 for 16-bit tables
                definitions.append((name, dict(shape=tuple(param.shape), dtype=dtype, initializer="normal",
                                               init_scale=table_init, seed=seed, partitioner=split,
                                               optimizer=param_opt, sparse=True)))
            else:
                raise InvalidArgumentError(f"{name}: only a sparse table may live on the meta device; build the "
                                           "other parameters on the CPU")
        for name in self.buffers:
            definitions.append((name, dict(initial_value=_numpy(name, module.get_buffer(name)),
                                           optimizer=optimizers.SGD(1.0))))
        self.variables: dict[str, Variable] = {name: coord.create_variable(prefix + name, **kwargs)
                                               for name, kwargs in definitions}
        # the tables' weights are left out of the skeleton that closures carry to the workers
        memo: dict[int, Any] = {}
        for name in self.tables:
            weight = module.get_parameter(name)
            memo[id(weight)] = nn.Parameter(torch.empty((0, *weight.shape[1:]), dtype=weight.dtype))
        self.skeleton = copy.deepcopy(module, memo)
        self.uid = uuid.uuid4().hex
        self._local = _REPLICAS.for_model(self.uid)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = _REPLICAS.for_model(self.uid)

    # -- worker side ------------------------------------------------------------------------------
    def _replica(self) -> _Replica:
        replica: _Replica | None = getattr(self._local, "replica", None)
        if replica is None:
            if self.worker_threads is not None:
                torch.set_num_threads(self.worker_threads)
            replica = self._local.replica = _Replica(self.skeleton, self.param_names, self.tables, self.buffers,
                                                     self.loss_scale)
        return replica

    @property
    def module(self) -> nn.Module:
        """This thread's replica of the module (parameters as of its last pull)."""
        return self._replica().module

    def pull(self, ids: Mapping[str, Any] | None = None) -> nn.Module:
        """Fill the module's parameters and buffers from the PS (one request per PS task) and, for each
        sparse table, the rows `ids[module path]` touches; clears gradients. Returns the module.

        Raises:
            InvalidArgumentError: ids for a module that is not a sparse table, a table without ids,
                non-integer or out-of-range ids.
        """
        replica = self._replica()
        ids = dict(ids or {})
        paths = {path: param for param, path in self.tables.items()}
        check_table_ids(list(paths), list(ids))
        inplace: list[tuple[Variable, torch.Tensor]] = []
        later: list[tuple[Variable, torch.Tensor]] = []  # received through the staging buffer, then copied
        for name, param in replica.params.items():
            param.grad = None
            if name not in self.tables:
                target = param.detach()
                (later if staged(target) else inplace).append((self.variables[name], target))
        for name, buf in replica.buffers.items():
            (later if staged(buf) else inplace).append((self.variables[name], buf))
        dense = [(var, t.numpy()) for var, t in inplace]
        views = replica.staging.views([(var.dtype, tuple(t.shape)) for var, t in later])
        dense += [(var, view) for (var, _), view in zip(later, views)]
        rows = []
        for path, id_values in ids.items():
            table_var = self.variables[paths[path]]
            wanted = unique_ids(path, id_values, table_var.shape[0])
            rows.append((table_var, wanted, replica.tables[paths[path]].load(wanted)))
        context.current_client().pull_into(dense, rows)
        replica.staging.copy_back([t for _, t in later], views)
        replica.pulled = {name: _host(buf).copy() for name, buf in replica.buffers.items()}
        return replica.module

    def push(self) -> list[int]:
        """Push every parameter's gradient, the tables' touched rows and the buffers' changes since
        pull(), under one push id (one request per PS task). Returns the new shard versions ([] when
        the step was skipped for a NaN or Inf under nonfinite="skip").

        Gradients are clipped (max_norm) and checked for NaN and Inf before anything is sent: under
        "reject" a bad one raises NonFiniteGradientError and no PS applies any part of the step.

        A parameter without a gradient is skipped (as torch.optim does), except in sync mode, where
        every replica must reach every shard of the step: it sends zeros there.
        """
        replica = self._replica()
        scope = context.current_scope()
        zeros_for_none = scope is not None and scope.sync_mode == "sync"
        policy = self.nonfinite
        if replica.scaler is not None:
            present = [p.grad for p in replica.params.values() if p.grad is not None]
            if not replica.scaler.unscale(present):
                # an overflow is the scaler's to skip (counted in replica.scaler.skipped): the client's skip
                # applies the step nowhere and, in a sync job, tells the step's shards so no replica waits
                policy = "skip"
        grads = []
        for name, param in replica.params.items():
            if name in self.tables:
                continue
            if param.grad is not None:
                grads.append((self.variables[name], grad_numpy(param.grad)))  # in the parameter's dtype
            elif zeros_for_none:
                grads.append((self.variables[name], np.zeros(tuple(param.shape), self.variables[name].dtype)))
        for name, buf in replica.buffers.items():
            before = replica.pulled.get(name)
            if before is None:
                raise InvalidArgumentError("push() before pull(): pull the module in the same closure first")
            grads.append((self.variables[name], before - _host(buf)))
        buffers = len(replica.buffers)
        rows = [(self.variables[param], *table.row_grads()) for param, table in replica.tables.items()]
        return context.current_client().push(grads, rows=rows, nonfinite=policy, max_norm=self.max_norm,
                                             norm_type=self.norm_type, unclipped=buffers)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), the loss multiplied by the replica's scale first with loss_scale="dynamic"."""
        scaler = self._replica().scaler
        (loss if scaler is None else scaler.scaled(loss)).backward()  # type: ignore[no-untyped-call]

    def precision_logs(self) -> dict[str, float]:
        """With loss_scale="dynamic": this replica's loss scale and the steps it skipped (else empty)."""
        scaler = self._replica().scaler
        return {} if scaler is None else {k: float(v) for k, v in scaler.state().items()}

    # -- driver side ------------------------------------------------------------------------------
    def parameter_variables(self) -> list[str]:
        """Names of the parameters' variables (not the buffers'): those a learning-rate change applies to."""
        return [self.prefix + name for name in self.variables if name not in self.buffers]

    def template(self) -> nn.Module:
        """A new copy of the module for the driver (tables at full size, values as built): load state_dict() into it."""
        net = copy.deepcopy(self.skeleton)
        for name in self.tables:
            path, _, leaf = name.rpartition(".")
            var = self.variables[name]
            full = torch.empty(var.shape, dtype=getattr(torch, var.dtype.name))
            setattr(net.get_submodule(path), leaf, nn.Parameter(full))
        return net

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The trained parameters and buffers, whole (tables included), keyed as module.state_dict()."""
        names = list(self.variables)
        values = dict(zip(names, context.current_client().pull([self.variables[n] for n in names])))
        return OrderedDict((key, torch.from_numpy(values[name])) for key, name in self.keys.items())
