"""Time spent in torch.distributed collectives: measured around each call, never estimated.

Two sources feed one ``CollectiveTimer``:

- the ``torch.distributed`` functions code calls by module attribute (``dist.all_reduce(...)``,
  FSDP's and DeepSpeed's calls), wrapped once per process by ``install()``;
- DDP's gradient all-reduce, which bypasses those functions, through a DDP communication hook
  (``time_ddp``) that runs the default all-reduce and times each bucket. Trainers (Hugging Face,
  Lightning) often hand callbacks the model *inside* the wrapper; ``watch_ddp`` then finds the
  wrapper at the model's first forward, which DDP runs with itself marked as the active module.

A collective on CPU tensors (gloo) is timed on the host, from the call until its future completes.
One on CUDA tensors is timed on the device, with CUDA events on the caller's stream, read later by
the publisher's sender thread, so nothing here waits for the device. ``take()`` returns the wall
time during which at least one collective was in flight (the union of the intervals, so
overlapping buckets are not counted twice) since the previous ``take()``. With each heartbeat,
``sample()`` reports ``collective_wait_s``: how long the oldest collective still in flight has
been waiting, which tells a rank stuck waiting for a peer from the peer that never came.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.contract import COLLECTIVE_WAIT

log = logging.getLogger(__name__)

#: The torch.distributed functions that are wrapped (those present in this torch).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
)

_TIMERS: list[CollectiveTimer] = []  # timers that currently want the wrapped functions' spans
_INSTALLED = False


def waited_within(spans: list[tuple[float, float, float | None, float | None]]) -> float:
    """The waiting clock's advance inside the union of ``(start, end, clock at start, clock at end)``
    spans: the training thread's wait for a CPU while a collective was in flight. A merged interval
    whose clock was not read at either end adds nothing.

    >>> waited_within([(0.0, 2.0, 10.0, 10.5), (1.0, 3.0, 10.2, 11.0), (5.0, 6.0, 12.0, 12.25)])
    1.25
    """
    total, reach, first, last = 0.0, float("-inf"), None, None
    for start, end, at_start, at_end in sorted(spans, key=lambda span: span[:2]):
        if start > reach:  # a new interval of the union: count the one before
            if first is not None and last is not None:
                total += max(0.0, last - first)
            first, reach, last = at_start, end, at_end
        elif end > reach:
            reach, last = end, at_end
    if first is not None and last is not None:
        total += max(0.0, last - first)
    return total


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals.

    >>> busy_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    4.0
    """
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class _CudaSpans:
    """Device-timed spans of one step: a lazy value (``done()`` / ``item()``) for the publisher."""

    def __init__(self, pairs: list[tuple[Any, Any]]):
        self._pairs = pairs

    def done(self) -> bool:
        return all(end.query() for _, end in self._pairs)

    def item(self) -> float:
        ref = self._pairs[0][0]
        return busy_time([(ref.elapsed_time(s) / 1e3, ref.elapsed_time(e) / 1e3) for s, e in self._pairs])


class _HostAndCuda:
    """A step that had both host- and device-timed collectives: their times add up."""

    def __init__(self, host_s: float, cuda: _CudaSpans):
        self._host_s, self._cuda = host_s, cuda

    def done(self) -> bool:
        return self._cuda.done()

    def item(self) -> float:
        return self._host_s + self._cuda.item()


class Remainder:
    """``left - collective`` (not below 0) for a device-timed ``collective`` from ``take()``: a lazy
    value, read when its events complete (the hook's ``compute_time_s`` on CUDA)."""

    __slots__ = ("left", "collective")

    def __init__(self, left: float, collective: Any):
        self.left, self.collective = left, collective

    def done(self) -> bool:
        return self.collective.done()

    def item(self) -> float:
        return max(0.0, self.left - self.collective.item())


class CollectiveTimer:
    """Collects collective spans from any thread; ``take()`` gives each step its busy time.

    It also knows which collectives are still in flight: ``waiting_s()`` is how long the oldest of
    them has been waiting. When a run stops, the ranks blocked in a collective are the ones
    waiting for a peer, and a rank that is *not* waiting is the one holding everybody up.
    """

    def __init__(self) -> None:
        # (call, completion, the training thread's CPU wait clock at both); appends are atomic across threads
        self._host: deque[tuple[float, float, float | None, float | None]] = deque()
        self._cuda: deque[tuple[Any, Any]] = deque()
        self._ids = itertools.count()
        self._open: dict[int, float] = {}  # host-timed calls in flight: id -> perf_counter at the call
        # Device-timed calls whose end event has not completed yet: (perf_counter at the call, end event).
        self._device_open: deque[tuple[float, Any]] = deque(maxlen=4096)
        self.calls = 0
        # The training thread's CPU wait so far, from any thread (``CpuWaitClock.owner_wait_s``): the
        # part of it inside collectives is no wait of the computing part of the step.
        self.cpu_wait: Callable[[], float | None] | None = None

    def begin(self, tensor: Any) -> Any:
        self.calls += 1
        key, now = next(self._ids), time.perf_counter()
        waited = self.cpu_wait() if self.cpu_wait is not None else None
        # In flight on the host until end(): a backend that runs CUDA collectives on the host (gloo)
        # calls it only when the peers have come, NCCL as soon as the kernel is queued.
        self._open[key] = now
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(tensor.device))
            return key, now, start, tensor.device, waited
        return key, now, None, None, waited

    def end(self, token: Any) -> None:
        key, began, start, device, waited = token
        self._open.pop(key, None)
        if start is not None:
            # On the caller's stream, which waits for the collective to finish before this event.
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(device))
            self._cuda.append((start, end))
            self._device_open.append((began, end))
        else:
            self._host.append((began, time.perf_counter(), waited, self.cpu_wait() if self.cpu_wait else None))

    def waiting_s(self) -> float:
        """Seconds the oldest collective still in flight has been waiting; 0.0 when none is."""
        now = time.perf_counter()
        while self._device_open and self._device_open[0][1].query():
            self._device_open.popleft()
        oldest = min(list(self._open.values()), default=now)  # list(): one step, safe against other threads
        if self._device_open:
            oldest = min(oldest, self._device_open[0][0])
        return max(0.0, now - oldest)

    def sample(self) -> dict[str, float]:
        """A heartbeat sampler (``RankPublisher.add_sampler``): ``collective_wait_s``."""
        return {COLLECTIVE_WAIT: self.waiting_s()}

    def take(self) -> tuple[float | _CudaSpans | _HostAndCuda, float]:
        """Busy time since the previous call (a float, or a lazy value when CUDA events are involved),
        and how long the training thread waited for a CPU inside the host-timed part of it."""
        host = [self._host.popleft() for _ in range(len(self._host))]
        cuda = [self._cuda.popleft() for _ in range(len(self._cuda))]
        host_s = busy_time([span[:2] for span in host])
        waited = waited_within(host) if self.cpu_wait is not None else 0.0
        if not cuda:
            return host_s, waited
        return (_HostAndCuda(host_s, _CudaSpans(cuda)) if host else _CudaSpans(cuda)), waited

    def start(self) -> None:
        """Receive the spans of the wrapped torch.distributed functions (installing them once)."""
        install()
        if self not in _TIMERS:
            _TIMERS.append(self)

    def stop(self) -> None:
        if self in _TIMERS:
            _TIMERS.remove(self)

    def watch_ddp(self, model: Any) -> Any:
        """Time the all-reduce of the DDP wrapper of ``model``, whether ``model`` is that wrapper or
        the module inside it; returns a handle to ``remove()`` (or None).

        Only the wrapper knows the module, not the other way round, so for the inner module a
        forward pre-hook asks DDP which wrapper is running the forward (it marks itself active
        for exactly that, for torch.compile), registers the comm hook there, and removes itself.
        That first forward comes before the first backward, which is when DDP needs its comm hook.
        """
        ddp = torch.nn.parallel.DistributedDataParallel
        if isinstance(model, ddp):
            self.time_ddp(model)
            return None
        active = getattr(ddp, "_get_active_ddp_module", None)
        if active is None or not isinstance(model, torch.nn.Module):
            return None  # a torch without it: only the torch.distributed functions are timed

        def probe(module: Any, args: Any) -> None:
            wrapper = active()
            if wrapper is None and not (module.training and torch.is_grad_enabled()):
                return  # an evaluation forward outside DDP: the training one will tell
            handle.remove()
            if wrapper is not None:
                self.time_ddp(wrapper)

        handle = model.register_forward_pre_hook(probe)
        return handle

    def time_ddp(self, model: Any) -> bool:
        """Time a DDP model's gradient all-reduce with a comm hook that runs the default all-reduce.

        False (with a warning) when the model already has a comm hook or DDP refuses a new one.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def timed_allreduce(process_group, bucket):
            token = self.begin(bucket.buffer())
            fut = allreduce_hook(process_group, bucket)

            def done(f):
                self.end(token)
                return f.value()

            return fut.then(done)

        try:
            model.register_comm_hook(None, timed_allreduce)
        except RuntimeError as exc:
            log.warning("rankwatch: DDP all-reduce not timed (%s)", exc)
            return False
        return True


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _wrap(fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        timers = list(_TIMERS)
        if not timers:
            return fn(*args, **kwargs)
        tensor = _first_tensor(args, kwargs)
        tokens = [(t, t.begin(tensor)) for t in timers]
        work = fn(*args, **kwargs)
        if work is not None and hasattr(work, "get_future"):  # async_op=True: time until completion
            try:
                work.get_future().then(lambda _f: [t.end(token) for t, token in tokens])
                return work
            except RuntimeError:  # a backend without futures: the call's own duration is all we know
                pass
        for t, token in tokens:
            t.end(token)
        return work

    timed.__rankwatch_wrapped__ = fn
    return timed


def install() -> None:
    """Wrap the torch.distributed collectives once per process (cheap pass-through when no timer listens)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__rankwatch_wrapped__"):
            setattr(dist, name, _wrap(fn))
    _INSTALLED = True
