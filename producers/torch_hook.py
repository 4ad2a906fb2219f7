"""TrainerHook: attach to a model's optimizer; each optimizer step publishes one point.

Per step (names as published):

- model: ``loss`` (mean over the micro-batches given to ``set_loss``), any keyword metrics, and
  flat stats dicts from ``log_stats`` (AReaL-style names such as ``ppo_actor/update/grad_norm``
  go in unchanged);
- optimisation: ``grad_norm`` (global L2 norm of the gradients the optimizer sees, the value
  ``clip_grad_norm_`` returns; a loop that clips passes its pre-clip result instead,
  ``set_loss(loss, grad_norm=total)``, which also saves the hook its pass over the gradients),
  ``grad_nonfinite`` (parameter tensors whose gradient holds a NaN or Inf), ``lr`` (param group 0;
  ``lr/group{i}`` for the others), ``step_skipped`` (1 when a ``GradScaler`` skipped the step), and
  every ``weight_stats_every`` steps ``param_norm`` and ``update_ratio`` (norm of the update over
  norm of the weights; that step copies the weights once, so it briefly needs their size again);
- system: ``step_time_s`` (between step ends), ``data_wait_s`` (time spent waiting on a loader
  wrapped with ``wrap_loader``), ``samples_per_s`` / ``tokens_per_s`` (when the counts are known),
  ``collective_time_s`` (when torch.distributed is initialised; see ``rankwatch.producers.collectives``),
  ``cpu_wait_s`` (on Linux, how long the training thread was ready to run but waited for a CPU),
  and ``compute_time_s``: the step time left after data wait, collectives and the CPU wait outside
  them. In DDP every rank's step takes as long as the slowest one's (they wait for each other in the
  all-reduce), so only this remainder shows which rank is the straggler, and a rank its host starves
  of CPU is not named for it;
- liveness: with each heartbeat, ``collective_wait_s`` (how long the rank has been blocked in an
  unfinished collective), so a run that stops can be told from the rank that stopped it.

Every step publishes the loss, the loop's own metrics and stats, and the step's times. Gradient
statistics, ``lr`` and the weight statistics are measured every ``every`` steps. By default
(``every=None``) that is every step where it costs the training thread little, and on fast loops
every 2nd to 64th step, so that measuring takes under 0.2% of the training time
(``rankwatch.producers.stride``); 0.2 s after a measured step, the next one is measured whatever the stride.

The training thread only launches fused per-tensor norm kernels (``torch._foreach_norm``, as
``clip_grad_norm_`` does); global norms, ratios, counts and means are computed from their host
copies on the publisher's sender thread (``rankwatch.producers.values.Derived``), so the training thread
never waits for the device. On a CPU model those kernels are the pass itself, a read of every
gradient, so the hook hands the gradient tensors to the sender thread, which computes their norms
there (``rankwatch.producers.grad_stats``). Process RSS, CPU and GPU memory are sampled by the sender thread
with each heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from rankwatch.producers.amp import after_scaler_update
from rankwatch.producers.collectives import CollectiveTimer
from rankwatch.producers.grad_norms import l2, norms
from rankwatch.producers.grad_stats import GradStats
from rankwatch.producers.publisher import RankPublisher
from rankwatch.producers.step_point import StepPoint
from rankwatch.producers.stride import MAX_EVERY, MAX_GAP_S, Stride
from rankwatch.producers.system import CpuWaitClock, CudaMemorySampler
from rankwatch.producers.values import Derived, stage


def _update_ratio(values: list[float]) -> float:
    half = len(values) // 2  # update norms, then weight norms
    return l2(values[:half]) / l2(values[half:])


def _multiple_from(step: int, k: int) -> int:
    """The first multiple of ``k`` at or after ``step``."""
    return -(-step // k) * k


class TrainerHook:
    """Publishes one point per optimizer step; gradient statistics every ``every`` steps. Usage::

        hook = TrainerHook(model, optimizer, publisher, samples_per_step=batch_size)
        for batch in hook.wrap_loader(loader):      # optional: measures data-loader wait
            loss = model(batch).loss
            loss.backward()
            hook.set_loss(loss)                      # optional; other metrics as keywords
            optimizer.step()                         # the hook publishes here
            optimizer.zero_grad()

    ``every`` fixes the stride (``every=1``: measure every step); ``hook.every`` is the current one.
    With a ``GradScaler``, pass ``scaler=``: the step then ends at ``scaler.update()``, which also
    tells whether the step was skipped. With ``attach=False`` nothing is hooked into the optimizer
    and the caller (the trainer adapters) calls ``before_step()``, ``after_step()`` and ``end_step()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        publisher: RankPublisher,
        *,
        start_step: int = 0,
        samples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        weight_stats_every: int = 100,
        scaler: Any = None,
        time_collectives: bool = True,
        publish_grad_norm: bool = True,
        every: int | None = None,
        attach: bool = True,
    ):
        if weight_stats_every < 0:
            raise ValueError(f"weight_stats_every must be >= 0 (0 = never), got {weight_stats_every}")
        if every is not None and not 1 <= every <= MAX_EVERY:
            raise ValueError(f"every must be None (adaptive) or 1..{MAX_EVERY}, got {every}")
        self.model, self.optimizer, self.publisher = model, optimizer, publisher
        self.step = start_step
        # A step's metrics are worked out from its facts on the sender thread (or here, on CUDA, where
        # the tensors are staged on this thread): see ``end_step``.
        self._point = StepPoint(samples_per_step, tokens_per_step)
        self._defer = publisher.defer
        self.weight_stats_every = weight_stats_every
        self._weights_at = _multiple_from(start_step, weight_stats_every) if weight_stats_every else 0
        # The stride: fixed by ``every``, else chosen by ``Stride``. Measured steps are its multiples,
        # so ranks with the same stride (or strides a power of two apart) measure the same steps.
        self.every, self._stride = every or 1, None if every else Stride()
        self._due = _multiple_from(start_step, self.every)  # the next step measured
        self._measured_at = 0.0  # when the last measured step ended
        self._overdue = MAX_GAP_S  # when the next step is measured whatever the stride
        self._spent = 0.0  # seconds in this measured step's callbacks so far
        self._scheduling = 0.0  # seconds in ``_schedule`` since the last measured step
        self._weighed = False  # whether this measured step took the weight statistics
        self._wake_sender = False
        self.scaler = scaler if scaler is not None and getattr(scaler, "is_enabled", lambda: False)() else None
        self.publish_grad_norm = publish_grad_norm
        self._metrics: dict[str, Any] = {}
        self._losses: list[Any] = []
        self._facts: dict[str, Any] = {}  # this step's micro-batch counts, for the StepPoint
        self._grads = GradStats([p for group in optimizer.param_groups for p in group["params"]])
        self._groups = self._grads.groups  # per (device, dtype), for the fused kernels
        self._snapshot: list[torch.Tensor] | None = None
        self._data_wait: float | None = None
        self._measured_step = 0  # the step after the last measured one, for the stride's step time
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []

        self._timer: CollectiveTimer | None = None
        self._ddp_probe: Any = None
        if time_collectives and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._timer = CollectiveTimer()
            self._timer.start()
            # DDP's all-reduce is timed whether the model given is the DDP wrapper or the module in it.
            self._ddp_probe = self._timer.watch_ddp(model)
            publisher.add_sampler(self._timer.sample)
        # The training thread's wait for a CPU, read at every step's end (Linux; None elsewhere).
        self._cpu_clock: CpuWaitClock | None = CpuWaitClock()
        if self._cpu_clock.read() is None:
            self._cpu_clock = None
        elif self._timer is not None:
            self._timer.cpu_wait = self._cpu_clock.owner_wait_s
        self._waited_inside = 0.0  # of that wait, the part inside the data wait (the collectives' is the timer's)
        # each step takes the waits measured (see ``_take_facts``)
        self._timing = self._timer is not None or self._cpu_clock is not None
        device = next((p.device for p in model.parameters()), None)
        self._on_cuda = device is not None and device.type == "cuda"
        if self._on_cuda:
            publisher.add_sampler(CudaMemorySampler(device))

        # Attached, the pre-hook is registered only for the steps measured (``_arm``): every callback
        # costs the training thread microseconds, even one that returns at once.
        self._attached, self._pre = attach, None
        if attach:
            self._arm()
            if self.scaler is None:
                self._handles.append(optimizer.register_step_post_hook(self._post_hook))
            else:
                self._handles.append(optimizer.register_step_post_hook(lambda *_: self.after_step()))
                end_step = lambda **kw: self.end_step(**kw)  # noqa: E731 (looked up per call, like the hooks)
                self._restore.append(after_scaler_update(self.scaler, optimizer, end_step))

    # -- what the user calls ---------------------------------------------------------------------

    @property
    def samples_per_step(self) -> int | None:
        """Samples in each step, for ``samples_per_s`` (a change applies to the steps not yet read)."""
        return self._point.samples_per_step

    @samples_per_step.setter
    def samples_per_step(self, n: int | None) -> None:
        self._point.samples_per_step = n

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens in each step, for ``tokens_per_s``."""
        return self._point.tokens_per_step

    @tokens_per_step.setter
    def tokens_per_step(self, n: int | None) -> None:
        self._point.tokens_per_step = n

    def set_loss(self, loss: torch.Tensor | float, *, samples: Any = None, tokens: Any = None, **extra: Any) -> None:
        """Record a micro-batch's loss (the step publishes the mean) and any other metrics.

        ``samples`` / ``tokens`` (ints or tensors) add up over the step's micro-batches, for
        ``samples_per_s`` / ``tokens_per_s``; they override the constructor's per-step counts.
        """
        # Not detached, not even checked: the sender reads it within about 0.1 s (a value that is not a
        # number is counted there as invalid), and either would cost more than the rest of this call.
        self._losses.append(loss)
        if samples is not None:
            self._facts.setdefault("samples", []).append(samples)
        if tokens is not None:
            self._facts.setdefault("tokens", []).append(tokens)
        if extra:
            self._metrics.update(extra)

    def log_stats(self, stats: Mapping[str, Any]) -> None:
        """Add a flat stats dict (numbers or 0-d tensors) to this step's point, names unchanged."""
        self._metrics.update(stats)

    def wrap_loader(self, loader: Iterable) -> Iterator:
        """Yield from ``loader``, timing each wait for the next batch; the step reports ``data_wait_s``."""
        iterator = iter(loader)
        self._data_wait, self._timing = 0.0, True
        clock = self._cpu_clock
        while True:
            started = time.perf_counter()
            cpu_wait = clock.owner_wait_s() if clock is not None else None
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._data_wait += time.perf_counter() - started
            if cpu_wait is not None and (now := clock.owner_wait_s()) is not None:
                self._waited_inside += now - cpu_wait  # loading in this thread (no workers) waits for a CPU too
            yield batch

    def detach(self) -> None:
        """Remove the optimizer hooks, the scaler wrapper and the collective timer."""
        for handle in self._handles:
            handle.remove()
        if self._pre is not None:
            self._pre.remove()
        for restore in self._restore:
            restore()
        if self._timer is not None:
            self._timer.stop()
        if self._ddp_probe is not None:
            self._ddp_probe.remove()
        if self._cpu_clock is not None:
            self._cpu_clock.close()
        self._handles, self._restore, self._pre, self._attached = [], [], None, False

    # -- step boundaries (hooked into the optimizer, or called by an adapter) --------------------

    def before_step(self) -> None:
        """Just before the optimizer updates the weights: gradient statistics and the weight snapshot."""
        # This runs right after the backward pass, when the interpreter's own data is out of the CPU
        # caches: every object made or branch taken here costs microseconds, so there are few.
        if self.step < self._due:
            return  # a step between measured ones (see ``every``)
        began = time.perf_counter()
        # A grad_norm already there is the caller's clip_grad_norm_ result: no second pass.
        if "grad_norm" not in self._metrics and (stats := self._grads.before()) is not None:
            self._publish_grad_stats(*stats)
        if self.weight_stats_every and self.step >= self._weights_at:
            self._weights_at = _multiple_from(self.step + 1, self.weight_stats_every)
            self._weighed = True  # a costly step, but a periodic one of its own: not the stride's business
            with torch.no_grad():  # only where needed: entering no_grad costs tens of µs after a backward pass
                self._snapshot = [torch._foreach_mul(group, 1.0) for group in self._groups]  # fused copies
        self._spent += time.perf_counter() - began

    def _publish_grad_stats(self, total: Any, nonfinite: Any) -> None:
        if self.publish_grad_norm:
            self._metrics["grad_norm"] = total
        self._metrics["grad_nonfinite"] = nonfinite

    def after_step(self) -> None:
        """Just after the update: learning rate, and the weight statistics when a snapshot was taken."""
        if self.step < self._due:
            return
        began = time.perf_counter()
        if (stats := self._grads.after()) is not None:  # a CPU model's gradients, probed by before_step
            self._publish_grad_stats(*stats)
            self._wake_sender = self._grads.handed and self._grads.handoff.prompt
        groups = self.optimizer.param_groups
        for i, group in enumerate(groups):
            lr = group.get("lr")
            if lr is not None:
                self._metrics["lr" if i == 0 else f"lr/group{i}"] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        if self._snapshot is not None:
            with torch.no_grad():
                for old, group in zip(self._snapshot, self._groups):
                    torch._foreach_sub_(old, group)  # old - new: the update, negated
                weights = norms(self._groups)
                self._metrics["param_norm"] = Derived(l2, weights)
                self._metrics["update_ratio"] = Derived(_update_ratio, norms(self._snapshot) + weights)
            self._snapshot = None
        self._spent += time.perf_counter() - began

    def end_step(self, step: int | None = None, *, skipped: Any = None) -> None:
        """Publish this step's point (at ``step`` if given, else the hook's own counter) and start the next."""
        # Only the step's facts are taken here, with as few lines as can be: this runs with the caches
        # cold (see ``before_step``). The sender thread works out the metrics (``StepPoint``).
        now = time.perf_counter()
        if step is not None:
            self.step = step
        metrics, losses = self._metrics, self._losses
        if metrics:
            self._metrics = {}
        else:
            metrics = None  # the empty dict stays the hook's, to fill next step
        if losses:
            self._losses = []
        else:
            losses = None
        facts = self._take_facts(skipped) if self._facts or self._timing or skipped is not None else None
        if self._on_cuda:  # the tensors are staged on this thread, behind the kernels that made them
            at, point = self._point(self.step, now, losses, metrics, facts)
            if point:
                self.publisher.log(stage(point), at)
        else:
            self._defer(self._point, self.step, now, losses, metrics, facts)
        self.step += 1
        if self.step >= self._due or now > self._overdue:
            self._schedule(now)

    def _schedule(self, now: float) -> None:
        """After a measured step, or before one, or when one is overdue: the stride's bookkeeping.

        Its own time counts as the next measured step's: it runs only because of the measured steps.
        """
        began = time.perf_counter()
        if self._wake_sender:  # large gradients handed over: read (and let go of) them now
            self._wake_sender = False
            self.publisher.wake()
        if self.step > self._due:  # the step just published was measured: when is the next one?
            if self._stride is not None and self._measured_at and self._spent and not self._weighed:
                per_step = (now - self._measured_at) / max(1, self.step - self._measured_step)
                self.every = self._stride.update(self._spent + self._scheduling, per_step)
            self._spent, self._scheduling, self._weighed, self._measured_step = 0.0, 0.0, False, self.step
            self._measured_at, self._overdue = now, now + MAX_GAP_S
            self._due = _multiple_from(self.step, self.every)
        elif now > self._overdue:
            self._due = self.step  # the loop slowed down: the next step is measured
        if self._attached and self.step >= self._due:
            self._arm()
        self._scheduling += time.perf_counter() - began

    def _take_facts(self, skipped: Any) -> dict[str, Any]:
        facts, self._facts = self._facts, {}
        if skipped is not None:
            facts["skipped"] = skipped
        if self._data_wait is not None:
            facts["data_wait_s"], self._data_wait = self._data_wait, 0.0
        inside, self._waited_inside = self._waited_inside, 0.0
        if self._timer is not None:
            facts["collective_time_s"], waited = self._timer.take()
            inside += waited
        if self._cpu_clock is not None:
            facts["cpu_clock"] = self._cpu_clock.read()
            facts["cpu_wait_inside_s"] = inside
        return facts

    # -- internals -------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Hook ``before_step`` into the next optimizer step (it stays while every step is measured)."""
        if self._pre is None:
            self._pre = self.optimizer.register_step_pre_hook(self._pre_hook)

    def _pre_hook(self, *_: Any) -> None:
        if self.every > 1 and self._pre is not None:
            self._pre.remove()
            self._pre = None
        self.before_step()

    def _post_hook(self, *_: Any) -> None:
        if self.step >= self._due:
            self.after_step()
        self.end_step()
