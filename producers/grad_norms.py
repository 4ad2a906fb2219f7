"""Gradient norms: fused per-tensor norms, the global statistics made of them, and a CPU model's
hand-off of its gradients to the publisher's sender thread.

On a GPU the per-tensor norms are one fused kernel, launched on the training thread and read later.
On a CPU model that kernel is the pass over the gradients itself, so ``TrainerHook`` hands the
gradient tensors to the sender thread instead (``Handoff``), which computes their norms there.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from rankwatch.producers.values import Unavailable

log = logging.getLogger(__name__)

#: Gradient bytes of a CPU model that may wait for the sender thread to read them. Past this (and
#: two steps' worth), the training thread computes a step's gradient norms itself, so a sender that
#: falls behind cannot make the gradients it has yet to read fill memory.
KEEP_GRAD_BYTES = 256 << 20

#: A CPU model with this many bytes of gradients per step has them read as soon as they are handed
#: over, not at the sender's next poll (up to 0.1 s later). Kept that long, they push the next
#: steps' gradients into fresh memory, which glibc returns to the system and the loop faults back
#: in: about 600-950 page faults per step on a 1.3M-parameter model in ``bench/step_cost.py``.
PROMPT_READ_BYTES = 1 << 20

# Gradient tensors per fused norm call on the sender thread: making each result a Python object
# holds the GIL, so a fast loop's hundred steps per wake-up are read in slices.
_READ_AT_ONCE = 64


def l2(values: list[float]) -> float:
    """The L2 norm of per-tensor L2 norms: the global norm (NaN and Inf propagate).

    >>> l2([3.0, 4.0])
    5.0
    """
    return math.sqrt(math.fsum(v * v for v in values))


def count_nonfinite(values: list[float]) -> float:
    return float(sum(not math.isfinite(v) for v in values))


def by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped per (device, dtype), the groups one fused kernel can take."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return list(groups.values())


def norms(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, one vector per device and dtype: a fused kernel and a stack each, no sync."""
    return [torch.stack(torch._foreach_norm(group, 2.0)) for group in groups if group]


class SenderGradNorms:
    """A CPU model's per-tensor gradient norms for one step, computed on the sender thread.

    The training thread keeps only references to the step's gradient tensors. ``zero_grad()``
    (``set_to_none=True``, torch's default) replaces them rather than changing them, so the sender
    reads them as the step left them; until it has (within about 0.1 s) they stay alive beside the
    next steps' gradients. The hook starts on the training thread and moves the work here only
    after a step that changed its gradients neither between ``before_step`` and ``after_step`` (a
    trainer that clips in between, in place) nor kept them for the next step (``set_to_none=False``);
    it moves back when a later step does either. A step whose gradients changed before the sender
    read them loses its values; they are never published wrong. One gradient is watched for that
    (``probe``, at version ``version``): what changes gradients in place (clipping, scaling,
    zeroing) changes all of them. ``on_changed(why)`` is called, on the sender thread, when it did.
    """

    __slots__ = ("_handoff", "_grads", "_probe", "_version", "_on_changed", "_values", "total", "nonfinite",
                 "__weakref__")

    def __init__(self, handoff: Handoff, grads: list[torch.Tensor], probe: torch.Tensor, version: int,
                 on_changed: Callable[[str], None]):
        self._handoff, self._grads, self._probe, self._version = handoff, grads, probe, version
        self._on_changed = on_changed
        self._values: list[float] | None = None
        self.total, self.nonfinite = _Of(self, l2), _Of(self, count_nonfinite)

    def holding(self) -> bool:
        """Whether it still keeps the step's gradients alive (until the sender has read them)."""
        return self._grads is not None

    def values(self) -> list[float]:
        if self._grads is not None:
            self._handoff.read()  # this step's and every other waiting step's, in one pass
        if self._values is None:  # for every value of the step, not only the first one asked for
            raise Unavailable("the gradients changed before they were read")
        return self._values

    def _settle(self, values: list[float]) -> None:
        """Keep ``values`` (this step's norms, just computed) unless the gradients changed meanwhile."""
        changed = self._probe._version != self._version
        self._grads = self._probe = None  # let go of the gradients
        if changed:
            self._on_changed("the gradients changed before the sender read them")
        else:
            self._values = values


class _Of:
    """``fn`` of a :class:`SenderGradNorms`, as a lazy value (ready at once; read on the sender thread)."""

    __slots__ = ("norms", "fn")

    def __init__(self, norms: SenderGradNorms, fn: Callable[[list[float]], float]):
        self.norms, self.fn = norms, fn

    def done(self) -> bool:
        return True

    def item(self) -> float:
        return self.fn(self.norms.values())


class Handoff:
    """The gradient sets handed to the sender that it has yet to read, bounded by ``KEEP_GRAD_BYTES``.

    ``grad_bytes`` is one step's gradients. The sender reads every waiting set in one fused pass
    (``read``): on a fast loop that is many steps per wake-up, and each call into torch costs the
    sender a hand-back of the GIL, which the training thread then waits to take back. The sets are
    held by weak references: a point the publisher dropped lets go of its gradients, and stops
    counting, when it is collected.
    """

    def __init__(self, grad_bytes: int):
        self.grad_bytes = grad_bytes
        self.prompt = grad_bytes >= PROMPT_READ_BYTES  # whether the sender should be woken to read at once
        self.unread: deque[weakref.ref] = deque()  # oldest first; read ones are dropped lazily by full()
        self._fits = max(2, KEEP_GRAD_BYTES // max(grad_bytes, 1))  # sets the bound allows
        self._check_at = min(self._fits, 64)  # below this many, ``full()`` is one len(): most steps
        self.refused = 0  # steps whose norms the training thread computed because the bound was reached

    def full(self) -> bool:
        """Whether one more step's gradients would pass the bound (always room for two steps)."""
        unread = self.unread
        if len(unread) < self._check_at:
            return False
        while unread and ((lazy := unread[0]()) is None or not lazy.holding()):  # read, or dropped
            unread.popleft()
        if len(unread) < self._fits:
            return False
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # log at 1, 2, 4, 8… such steps
            log.warning("rankwatch: the sender thread has yet to read %d steps of gradients (%.0f MiB); "
                        "gradient norms computed on the training thread meanwhile (%d steps so far)",
                        len(unread), len(unread) * self.grad_bytes / 2**20, self.refused)
        return True

    def hand(self, grads: list[torch.Tensor], probe: torch.Tensor, version: int,
             on_changed: Callable[[str], None]) -> SenderGradNorms:
        lazy = SenderGradNorms(self, grads, probe, version, on_changed)
        self.unread.append(weakref.ref(lazy))
        return lazy

    def read(self) -> None:
        """On the sender thread: the norms of every set still waiting, in fused calls of up to 64 tensors."""
        # list() of a deque copies it without running Python code, so the training thread cannot
        # append to it meanwhile; read sets are left for full() to drop.
        waiting = [lazy for ref in list(self.unread) if (lazy := ref()) is not None and lazy.holding()]
        grads = [g for lazy in waiting for g in lazy._grads]
        values: list[float] = []
        with torch.no_grad():  # gradients made with create_graph=True would grow a graph
            for at in range(0, len(grads), _READ_AT_ONCE):
                if at:
                    time.sleep(0)  # hand the GIL back between slices: the training thread never waits long
                values += torch.stack(torch._foreach_norm(grads[at:at + _READ_AT_ONCE], 2.0)).tolist()
        at = 0
        for lazy in waiting:  # the version checks come after the reads: a change during one is caught
            n = len(lazy._grads)
            lazy._settle(values[at:at + n])
            at += n
