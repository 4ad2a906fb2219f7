"""Turning logged values into floats on the sender thread, without ever waiting on a device.

A logged value is a number, a one-element tensor, a ``Derived`` value (a function of tensors,
computed here), or a *lazy value*: any object with ``item()`` and, optionally, ``done()`` (an
unfinished ``done()`` means "not yet": the sender asks again later instead of blocking; an
``item()`` that raises ``Unavailable`` means "never": the point goes without it).

A one-element CPU tensor is read where it is met; the elements of other tensors once per chunk,
however many values use them. CUDA tensors are gathered per device into one buffer and copied
asynchronously into pinned memory behind a CUDA event, so a hung device (a stuck collective)
stalls those values only: the sender thread keeps running, and heartbeats keep flowing. The copy
is best started by the thread (and so on the stream) that produced the tensors, with ``stage()``:
``TrainerHook`` does this. A CUDA tensor that reaches the sender unstaged is copied there, on the
device's current stream of the sender thread, which is right for work on the default stream.
torch is only touched when a value is a tensor, so torch-free processes never import it.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

Point = tuple[int, Mapping[str, Any]]

# Values read between two hand-backs of the GIL (tens of µs of Python). Each hand-back is a system
# call costing about as much CPU as reading 20 values, so not one per point.
_YIELD_EVERY = 32


class Invalid(ValueError):
    """A logged value that is not a number (a string, a tensor with several elements, …)."""


class Unavailable(Exception):
    """Raised by a lazy value's ``item()`` when its value can no longer be known: the point goes
    without it, and it counts as neither invalid nor failed."""


class Derived:
    """A metric computed on the sender thread from the host copies of tensors: ``fn([floats]) -> float``.

    ``fn`` gets the elements of ``tensors`` (numbers or tensors of any shape), flattened, in order.
    The training thread only launches the kernels that produce the tensors (e.g. one fused
    per-tensor norm); sums, square roots and counts over them run here, off the training thread.

    >>> Derived(sum, [1.0, 2.0]).fn([1.0, 2.0])
    3.0
    """

    __slots__ = ("fn", "tensors")

    def __init__(self, fn: Callable[[list[float]], float], tensors: list[Any]):
        self.fn, self.tensors = fn, list(tensors)


class _DeviceCopy:
    """One device's tensors on their way to the host; ``done()`` polls a CUDA event."""

    def __init__(self, tensors: list[Any], torch: Any):
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        self._sizes = [t.numel() for t in tensors]
        self._values: list[list[float]] | None = None
        self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self._host.copy_(flat, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(flat.device))

    def done(self) -> bool:
        return self._event.query()

    def values(self) -> list[list[float]]:
        if self._values is None:
            flat, self._values, at = self._host.tolist(), [], 0
            for n in self._sizes:
                self._values.append(flat[at:at + n])
                at += n
        return self._values


class Staged:
    """A CUDA tensor whose host copy ``stage()`` started: element list ``index`` of ``copy``."""

    __slots__ = ("copy", "index")

    def __init__(self, copy: _DeviceCopy, index: int):
        self.copy, self.index = copy, index


def stage(metrics: dict[str, Any]) -> dict[str, Any]:
    """Start the host copy of every CUDA tensor in ``metrics`` (values and ``Derived`` inputs).

    Runs on the thread that produced the tensors, so the copy is queued on their stream, behind the
    kernels that compute them: one gather and one asynchronous copy per device, no wait.
    """
    torch = sys.modules["torch"]
    found: dict[Any, dict[int, Any]] = defaultdict(dict)  # device -> id -> tensor
    for value in metrics.values():
        for t in value.tensors if isinstance(value, Derived) else (value,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                found[t.device][id(t)] = t
    if not found:
        return metrics
    staged: dict[int, Staged] = {}
    for tensors in found.values():
        copy = _DeviceCopy(list(tensors.values()), torch)
        staged.update({key: Staged(copy, i) for i, key in enumerate(tensors)})

    def swap(t: Any) -> Any:
        return staged.get(id(t), t) if isinstance(t, torch.Tensor) else t

    return {name: Derived(value.fn, [swap(t) for t in value.tensors]) if isinstance(value, Derived) else swap(value)
            for name, value in metrics.items()}


class Chunk:
    """Points logged between two sender wake-ups, plus what must wait for them (events, flush markers).

    Built at once on the sender thread; ``ready()`` says whether every value can now be read without
    blocking, and ``resolve()`` returns ``(step, name, float)`` triples in logging order.
    """

    def __init__(self, points: list[Point], events: list[Any], markers: list[Any]):
        self.events, self.markers = events, markers
        self.final = False  # the publisher's last chunk: its batch tells processors the rank stops on purpose
        self.invalid: list[str] = []
        self._torch = sys.modules.get("torch")
        self._slots: list[tuple[int, str, Any]] = []
        self._cells: list[list[float] | None] = []  # the elements of every tensor read, once each
        self._cell_of: dict[int, int] = {}  # id(tensor) -> cell; the points keep the tensors alive
        self._computed: list[tuple[int, Callable | None, list[int]]] = []  # slot <- fn(cells' elements)
        self._cuda: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
        self._copies: list[tuple[_DeviceCopy, list[int]]] = []
        self._lazy: list[tuple[Any, int]] = []
        self._staged: list[tuple[int, Staged]] = []
        slots, since_yield = self._slots, 0
        tensor = None if self._torch is None else self._torch.Tensor
        for step, metrics in points:
            for name, value in metrics.items():
                if type(value) is float:  # most values: the training thread's own clocks and counts
                    slots.append((step, name, value))
                elif type(value) is tensor and not value.is_cuda:  # a loss: read where it is met
                    try:
                        slots.append((step, name, float(value.item())))
                    except (RuntimeError, TypeError, ValueError):  # several elements, or not a real number
                        self._add(step, name, value)
                else:
                    self._add(step, name, value)
            since_yield += len(metrics)
            if since_yield >= _YIELD_EVERY:
                since_yield = 0
                time.sleep(0)  # hand the GIL back: the training thread never waits long for it
        for members in self._cuda.values():
            self._copies.append((_DeviceCopy([t for _, t in members], self._torch), [c for c, _ in members]))
        self._cuda.clear()

    def _add(self, step: int, name: str, value: Any) -> None:
        index = len(self._slots)
        self._slots.append((step, name, None))
        torch = self._torch
        if isinstance(value, (int, float)):  # bool included: a flag is 0/1
            self._slots[index] = (step, name, float(value))
        elif isinstance(value, Staged):
            self._computed.append((index, None, [self._cell(value)]))
        elif isinstance(value, Derived):
            if all(isinstance(t, (int, float, Staged)) or (torch is not None and isinstance(t, torch.Tensor))
                   for t in value.tensors):
                self._computed.append((index, value.fn, [self._cell(t) for t in value.tensors]))
            else:
                self._reject(index, "a Derived value over something other than numbers and tensors")
        elif torch is not None and isinstance(value, torch.Tensor):
            if value.numel() == 1:
                self._computed.append((index, None, [self._cell(value)]))
            else:
                self._reject(index, f"a tensor of {value.numel()} elements")
        elif hasattr(value, "done"):
            self._lazy.append((value, index))
        elif hasattr(value, "item"):  # numpy scalars
            self._set(index, value.item())
        else:
            self._reject(index, type(value).__name__)

    def _cell(self, value: Any) -> int:
        if isinstance(value, (int, float)):
            self._cells.append([float(value)])
            return len(self._cells) - 1
        if isinstance(value, Staged):
            self._cells.append(None)
            self._staged.append((len(self._cells) - 1, value))
            return len(self._cells) - 1
        cell = self._cell_of.get(id(value))
        if cell is None:
            cell = self._cell_of[id(value)] = len(self._cells)
            if value.is_cuda:
                self._cells.append(None)
                self._cuda[value.device].append((cell, value))
            else:
                elements = value.tolist() if value.dim() <= 1 else value.reshape(-1).tolist()
                self._cells.append(elements if isinstance(elements, list) else [elements])
        return cell

    def _set(self, index: int, value: Any) -> None:
        step, name, _ = self._slots[index]
        try:
            self._slots[index] = (step, name, float(value))
        except (TypeError, ValueError):
            self._reject(index, type(value).__name__)

    def _reject(self, index: int, what: str) -> None:
        step, name, _ = self._slots[index]
        self._slots[index] = (step, name, Invalid(what))
        self.invalid.append(name)

    def __len__(self) -> int:
        return len(self._slots)

    def ready(self) -> bool:
        return (all(c.done() for c, _ in self._copies) and all(s.copy.done() for _, s in self._staged)
                and all(v.done() for v, _ in self._lazy))

    def resolve(self) -> list[tuple[int, str, float]]:
        for copy, cells in self._copies:
            for c, values in zip(cells, copy.values()):
                self._cells[c] = values
        for c, staged in self._staged:
            self._cells[c] = staged.copy.values()[staged.index]
        for index, fn, cells in self._computed:
            values = [v for c in cells for v in self._cells[c]]
            try:
                self._set(index, values[0] if fn is None else fn(values))
            except Exception as exc:  # fn is the caller's code; its failure costs one point
                self._reject(index, f"its function raised {exc!r}")
        for value, index in self._lazy:
            try:
                self._set(index, value.item())
            except Unavailable:
                pass  # the slot stays empty; resolve() returns floats only
            except Exception as exc:  # a lazy value is user code; its failure costs one point
                self._reject(index, f"{type(value).__name__}.item() raised {exc!r}")
        self._copies, self._computed, self._lazy, self._staged = [], [], [], []
        return [(s, n, v) for s, n, v in self._slots if isinstance(v, float)]
