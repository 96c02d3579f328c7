"""Sparse embedding tables on a worker: a compact local table of the rows one step touches.

An `nn.Embedding` or `nn.EmbeddingBag` built with `sparse=True` is a sparse PS variable. On a worker
its weight is replaced, each step, by the rows the batch's ids touch (sorted unique ids, pulled
straight into the local weight), and a forward pre-hook maps the global ids the model is called
with onto rows of that local table; the sparse gradient of the local table becomes a row push of
the touched rows only. Worker memory is O(rows in a batch), never O(table).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pscluster.client.variables import unique_rows
from pscluster.errors import InvalidArgumentError

TABLE_TYPES = (nn.Embedding, nn.EmbeddingBag)
TableModule = nn.Embedding | nn.EmbeddingBag


def sparse_tables(module: nn.Module) -> dict[str, str]:
    """{parameter name of the table's weight: module path} for every sparse Embedding/EmbeddingBag.

    Raises:
        InvalidArgumentError: a sparse table with max_norm (it renormalises rows in place, which the
            PS would never see).
    """
    found = {}
    for path, sub in module.named_modules():
        if isinstance(sub, TABLE_TYPES) and sub.sparse:
            if sub.max_norm is not None:
                raise InvalidArgumentError(f"{path or type(sub).__name__}: max_norm is not supported on a sparse "
                                           "PS table (rows are renormalised in place on the worker); drop max_norm")
            found[f"{path}.weight" if path else "weight"] = path
    return found


def unique_ids(name: str, ids: Any, rows: int) -> np.ndarray:
    """Sorted unique int64 ids of a batch (a tensor or array-like) for table `name` of `rows` rows.

    Raises:
        InvalidArgumentError: non-integer ids, or ids outside [0, rows).
    """
    return unique_rows(name, ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids), rows)


class LocalTable:
    """The rows of one table pulled for the current step, and the hook that maps ids onto them."""

    def __init__(self, name: str, module: TableModule) -> None:
        self.name = name
        self.module = module
        self.padding_idx = module.padding_idx  # the global padding row, if any
        self.ids = np.empty(0, np.int64)
        self._sorted = torch.empty(0, dtype=torch.int64)
        module.register_forward_pre_hook(self._to_local, with_kwargs=True)

    def load(self, ids: np.ndarray) -> np.ndarray:
        """Install an empty local weight for sorted unique `ids`; returns its numpy view to pull into."""
        dim = self.module.weight.shape[1]
        weight = torch.empty((ids.size, dim), dtype=self.module.weight.dtype)
        self.module.weight = nn.Parameter(weight)
        self.ids = ids
        self._sorted = torch.from_numpy(ids)
        if self.padding_idx is not None:
            at = int(np.searchsorted(ids, self.padding_idx))
            self.module.padding_idx = at if at < ids.size and ids[at] == self.padding_idx else None
        return weight.numpy()

    def _to_local(self, _module: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = (args[0] if args else kwargs["input"]).long()
        local = torch.searchsorted(self._sorted, ids)
        found = local < self._sorted.numel()
        hit = torch.zeros_like(found)
        hit[found] = self._sorted[local[found]] == ids[found]
        if not bool(hit.all()):
            missing = ids[~hit].reshape(-1)[0].item()
            raise InvalidArgumentError(f"{self.name}: id {missing} was not pulled this step; pass every id the "
                                       f"model looks up to pull(ids={{{self.name!r}: ...}})")
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "input": local}

    def row_grads(self) -> tuple[np.ndarray, np.ndarray]:
        """(global ids, gradients) of the rows the backward pass touched."""
        grad = self.module.weight.grad
        dim = self.module.weight.shape[1]
        if grad is None:
            return np.empty(0, np.int64), np.empty((0, dim), self.module.weight.detach().numpy().dtype)
        if grad.is_sparse:
            grad = grad.coalesce()
            rows = grad.indices()[0].numpy()
            return self.ids[rows], grad.values().contiguous().numpy()
        return self.ids, grad.contiguous().numpy()  # a dense gradient of the local table: all its rows
