"""A module standing in for nn.Embedding / nn.EmbeddingBag over raw int64 ids: a dynamic PS table.

    table = coord.create_variable("user", shape=(None, 16), sparse=True, optimizer=ps.Adagrad(0.05),
                                  table=TableConfig(dim=16, admission=Admission("counter", min_count=2)))
    emb = DynamicEmbedding(table, mode="sum")        # mode None: as nn.Embedding
    def step(it):
        ids, offsets, y = next(it)                   # ids: any int64 (hashed feature ids)
        loss = F.binary_cross_entropy_with_logits(emb(ids, offsets).sum(1), y)
        loss.backward()
        emb.push()                                   # the gradients of the rows this forward pulled
        return loss.item()

Each forward pulls the rows of the batch's unique keys (from the thread's PS client: the closure's)
into a small leaf tensor; backward fills its gradient; push() sends it as one row push. Worker memory
follows the batch, never the table. One forward per push per thread: what a forward pulled is the
calling thread's, so closures running at once on a worker's threads may share one module.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the name torch code uses
from torch import nn

from pscluster.client.variables import Variable
from pscluster.errors import FailedPreconditionError, InvalidArgumentError

MODES = (None, "sum", "mean", "max")


class DynamicEmbedding(nn.Module):
    """Embedding rows of a dynamic table (create_variable(shape=(None, dim), sparse=True))."""

    def __init__(self, table: Variable, mode: str | None = None) -> None:
        super().__init__()
        if not isinstance(table, Variable) or not table.dynamic:
            raise InvalidArgumentError(f"DynamicEmbedding needs a dynamic table (shape=(None, dim), sparse=True), "
                                       f"got {table!r:.80}")
        if mode not in MODES:
            raise InvalidArgumentError(f"DynamicEmbedding mode must be one of {MODES}, got {mode!r}")
        self.table = table
        self.mode = mode
        self._pulled = threading.local()  # this thread's last forward: .keys and .rows (a worker runs closures at once)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[no-untyped-call]
        state.pop("_pulled", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._pulled = threading.local()

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """As nn.Embedding(ids) (mode None) or nn.EmbeddingBag(ids, offsets, per_sample_weights)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"{self.table.name}: ids must be int64 (or int32), got {ids.dtype}")
        flat = ids.detach().reshape(-1).to(torch.int64).cpu().numpy()
        keys, inverse = np.unique(flat, return_inverse=True)
        rows = torch.from_numpy(self.table.pull_rows(keys)).requires_grad_(True)
        self._pulled.keys, self._pulled.rows = keys, rows
        local = torch.from_numpy(inverse.reshape(tuple(ids.shape)))
        if self.mode is None:
            return F.embedding(local, rows)
        return F.embedding_bag(local, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def push(self) -> list[int]:
        """Push the gradients of the rows this thread's last forward pulled; returns the shards' versions.

        Raises:
            FailedPreconditionError: no forward on this thread since its last push, or no backward through it.
        """
        rows: torch.Tensor | None = getattr(self._pulled, "rows", None)
        if rows is None or rows.grad is None:
            raise FailedPreconditionError(f"{self.table.name}: push() needs a forward and a backward first "
                                          "(on the same thread)")
        self._pulled.rows = None
        return self.table.push_rows(self._pulled.keys, rows.grad.numpy())
