"""TrainerHook: attach to a model's optimizer; each ``optimizer.step()`` publishes one point.

Per step: ``loss`` (when given with ``set_loss``), ``grad_norm`` (global L2 norm of all gradients,
one fused device computation, the value ``clip_grad_norm_`` would report), ``grad_nonfinite``
(1.0 when any gradient is NaN/Inf), and ``step_time_s`` (wall time since the previous step).
Values stay tensors until the publisher's sender thread reads them, so the training thread never
waits for the device.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from producers.publisher import RankPublisher


class TrainerHook:
    """Publishes one point per ``optimizer.step()``. Usage::

        hook = TrainerHook(model, optimizer, publisher)
        ...  # each step, after backward(): hook.set_loss(loss)
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, publisher: RankPublisher, *, start_step: int = 0):
        self.model, self.optimizer, self.publisher = model, optimizer, publisher
        self.step = start_step
        self._loss: torch.Tensor | None = None
        self._extra: dict[str, Any] = {}
        self._grad_norm: torch.Tensor | None = None
        self._last_step_end: float | None = None
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def set_loss(self, loss: torch.Tensor | float, **extra: Any) -> None:
        """Record this step's loss (and any other metrics) for the next optimizer step to publish."""
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self._extra.update(extra)

    def _before_step(self, optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Same norm clip_grad_norm_ computes (foreach kernels, no per-parameter host sync).
        self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None

    def _after_step(self, optimizer, args, kwargs) -> None:
        now = time.perf_counter()
        metrics: dict[str, Any] = dict(self._extra)
        if self._loss is not None:
            metrics["loss"] = self._loss
        if self._grad_norm is not None:
            metrics["grad_norm"] = self._grad_norm
            metrics["grad_nonfinite"] = (~torch.isfinite(self._grad_norm)).float()
        if self._last_step_end is not None:
            metrics["step_time_s"] = now - self._last_step_end
        self._last_step_end = now
        if metrics:
            self.publisher.log(metrics, self.step)
        self.step += 1
        self._loss, self._grad_norm, self._extra = None, None, {}

    def detach(self) -> None:
        """Remove the optimizer hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
