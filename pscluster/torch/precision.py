"""Mixed precision and devices for PSModule: float32 masters on the PS, the module's own dtype and device on
the worker.

- A bfloat16/float16 parameter is a float32 variable on the PS (its master). `pull()` receives the
  masters into one float32 staging buffer per request and copies each into its parameter (a cast, and
  a host-to-device copy when the module lives on a GPU: the staging buffer is pinned there). `push()`
  sends the gradient in the parameter's dtype, half the bytes of float32 (bfloat16 as ml_dtypes'
  numpy dtype); the PS upcasts it before the optimizer.
- A float32 CPU parameter is filled in place, as before: nothing is staged.
- `LossScaler` is torch.cuda.amp.GradScaler's dynamic rule for float16 on the worker: the loss is
  multiplied by the scale before backward; a step whose gradients are not all finite is not pushed at
  all (so every PS skips it alike), counted, and halves the scale; `growth_interval` finite steps in a
  row double it. Gradients are unscaled in their own dtype before the push.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pscluster.errors import InvalidArgumentError

HALF = (torch.float16, torch.bfloat16)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the PS variable that holds a parameter of `dtype` (float32 for 16-bit floats)."""
    return torch.float32 if dtype in HALF else dtype


def staged(tensor: torch.Tensor) -> bool:
    """True when pull() cannot receive into the tensor's own memory (16-bit float, or not on the CPU)."""
    return tensor.dtype in HALF or tensor.device.type != "cpu"


def grad_numpy(grad: torch.Tensor) -> np.ndarray:
    """A gradient as a numpy array in its own dtype on the host (bfloat16 as ml_dtypes.bfloat16)."""
    host = grad.detach().contiguous()
    if host.device.type != "cpu":
        host = host.cpu()
    if host.dtype == torch.bfloat16:
        import ml_dtypes

        return host.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return host.numpy()


class Staging:
    """One host buffer (pinned when CUDA is present) for the tensors a pull cannot fill in place."""

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def views(self, wanted: list[tuple[np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
        """A numpy view per (master dtype, shape), back to back in the buffer (grown once, then reused)."""
        spans, total = [], 0
        for dtype, shape in wanted:
            spans.append(total)
            total += -(-int(np.prod(shape)) * dtype.itemsize // self.ALIGN) * self.ALIGN
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        flat = self._buffer.numpy()
        return [flat[at:at + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
                for at, (dtype, shape) in zip(spans, wanted)]

    @staticmethod
    def copy_back(tensors: list[torch.Tensor], views: list[np.ndarray]) -> None:
        """Copy each staged float32 value into its tensor (cast to its dtype, moved to its device)."""
        with torch.no_grad():
            for t, v in zip(tensors, views):
                t.copy_(torch.from_numpy(v), non_blocking=t.device.type == "cuda")
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize()  # the staging buffer is reused by the next pull


class LossScaler:
    """Dynamic loss scaling (GradScaler's rule) for a float16 module, kept per worker replica."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale."""
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide the gradients by the scale in place; False (and the scale backs off, the step counted as
        skipped) when any of them is not finite."""
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.scale *= self.backoff_factor
            return False
        for g in grads:
            g.div_(self.scale)
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            self.scale *= self.growth_factor
        return True

    def state(self) -> dict[str, Any]:
        """scale and skipped steps (for the step's logs)."""
        return {"loss_scale": self.scale, "skipped_steps": self.skipped}


def check_loss_scale(loss_scale: str | None) -> None:
    """Raises InvalidArgumentError unless loss_scale is None or "dynamic"."""
    if loss_scale not in (None, "dynamic"):
        raise InvalidArgumentError(f"loss_scale={loss_scale!r}: use None or 'dynamic' (float16 modules)")
