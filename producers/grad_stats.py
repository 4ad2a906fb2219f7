"""Where a measured step's ``grad_norm`` and ``grad_nonfinite`` are worked out, for ``TrainerHook``.

On a GPU: from one fused per-tensor norm launched on the training thread, read later by the sender
thread. On a CPU model that launch would be the pass over the gradients itself, so the gradient
tensors are handed to the sender thread after the update, which reads them there
(``grad_norms.Handoff``). That is only right if nothing changes the gradients between the
optimizer's pre-hook and its post-hook (a trainer that clips them in place there), and if the loop
replaces its gradients from step to step rather than zeroing them in place: one trainable
parameter's gradient is watched for both, and the first step that shows otherwise moves the work
back to the training thread for good.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from rankwatch.producers.grad_norms import Handoff, by_device, count_nonfinite, l2, norms
from rankwatch.producers.values import Derived

log = logging.getLogger(__name__)


class GradStats:
    """``before()`` just before the optimizer's update, ``after()`` just after, on measured steps.

    Each returns ``(grad_norm, grad_nonfinite)`` as lazy values when it worked them out, else None;
    ``handed`` says whether the last ``after()`` handed the gradients to the sender thread.
    """

    def __init__(self, params: list[torch.Tensor]):
        # Parameter lists per (device, dtype) for the fused kernels; groups added later are not watched.
        self.groups = by_device(params)
        self._flat = [p for group in self.groups for p in group]  # a CPU model's, for the sender (one pass)
        # On a CPU model: None until the first step showed that nothing changes the gradients between
        # before() and after() (a trainer that clips in between, in place).
        cpu = all(group[0].device.type == "cpu" for group in self.groups if group)
        self.on_sender: bool | None = None if cpu else False
        self.probe_param = next((p for group in self.groups for p in group if p.requires_grad), None)
        if self.probe_param is None:
            self.on_sender = False
        self.handoff = Handoff(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
        self._last_grad: weakref.ref | None = None  # the previous step's probed gradient
        self._probe: tuple[torch.Tensor, int] | None = None  # this step's probed gradient and its version
        self.handed = False

    def before(self) -> tuple[Any, Any] | None:
        # On a CPU model only one gradient is read here, with its version; the rest are gathered by
        # after(), where that version shows whether anything changed them in between.
        probe = None if self.on_sender is False else self.probe_param.grad
        if probe is not None:
            self._probe = (probe, probe._version)
        if probe is None or self.on_sender is None:
            return self._here()
        return None

    def after(self) -> tuple[Any, Any] | None:
        self.handed = False
        if self._probe is None:  # not a CPU model's step handed to the sender
            return None
        (grad, version), self._probe = self._probe, None
        if grad._version != version or self.probe_param.grad is not grad:
            self._to_training_thread("the gradients changed between before_step and after_step (clipping?)")
            return None  # unless the first step computed them in before(), gone: never published wrong
        kept = self._last_grad is not None and self._last_grad() is grad
        self._last_grad = weakref.ref(grad)
        if self.on_sender is None:  # the first step: computed by before()
            self.on_sender = True
            return None
        # Kept: zeroed in place next step, perhaps before the sender could read them. Full: the sender
        # is behind, so no more gradients are kept alive for it. Either way they are read here.
        if kept or self.handoff.full():
            if kept:
                self._to_training_thread("the loop keeps its gradient tensors from step to step")
            return self._here()
        grads = [g for p in self._flat if (g := p.grad) is not None]
        lazy = self.handoff.hand(grads, grad, version, self._to_training_thread)
        self.handed = True
        return lazy.total, lazy.nonfinite

    def _here(self) -> tuple[Any, Any] | None:
        """From one fused per-tensor norm launched on this thread, its only device work; the global
        norm (the value ``clip_grad_norm_`` returns) and the non-finite count are the sender's."""
        grads = [[g for p in group if (g := p.grad) is not None] for group in self.groups]
        if not any(grads):
            return None
        with torch.no_grad():  # grads made with create_graph=True would grow a graph
            grad_norms = norms(grads)
        return Derived(l2, grad_norms), Derived(count_nonfinite, grad_norms)

    def _to_training_thread(self, why: str) -> None:
        if self.on_sender is not False:
            self.on_sender = False
            log.info("rankwatch: %s: grad_norm is computed on the training thread from now on", why)
