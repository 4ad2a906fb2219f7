"""Evaluator: decides at which training steps to evaluate.

Three triggers, OR-combined, each counting from its own last firing (AReaL's semantics):
``freq_steps`` optimizer steps, ``freq_secs`` seconds of wall time, ``freq_epochs`` epochs; a
trigger left at None never fires. Two things AReaL gets wrong are fixed here:
``eval_before_train`` evaluates the weights *before* the first update (the first check of a fresh
run fires; a run restored with ``load_state_dict`` does not evaluate again), and
``freq_secs`` works without torch.distributed. When torch.distributed is initialised and the
decision can differ between ranks (wall clocks, advice arriving at different moments), rank 0
decides and broadcasts, so all ranks evaluate at the same steps.

Counters are absolute: ``step`` is the number of optimizer updates the weights have seen, so
asking twice at one step fires at most once, and ``state_dict()`` / ``load_state_dict()`` carry the
schedule across a restart (time since the last evaluation is kept; the downtime is not counted).
The epoch trigger fires only at an epoch's first check, so a run resumed mid-epoch (even one that
turns ``freq_epochs`` on only now) waits for the next epoch. ``final(step=…)`` after the last update
says whether the final weights still need their evaluation: periodic triggers alone stop short
(``freq_steps=3`` over 30 steps last fires at 27; ``freq_epochs=1`` with one epoch never fires).

torch is imported only when torch.distributed is in use, so the Evaluator works in torch-free code.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

TRIGGERS = ("before_train", "steps", "secs", "epochs")
_STATE_VERSION = 1


class IntervalAdvice(Protocol):
    """What the Evaluator needs from a control listener (``rankwatch.producers.ControlListener`` has it)."""

    def eval_interval(self) -> float | None: ...


class Evaluator:
    """Call ``should_evaluate`` once per step, before the optimizer step, on every rank::

        evaluator = Evaluator(freq_steps=200, freq_secs=1800, eval_before_train=True)
        for epoch in range(epochs):
            for batch in loader:
                if evaluator.should_evaluate(step=step, epoch=epoch):
                    evaluate_shard(...)          # evaluates the weights after `step` updates
                ...                              # forward, backward, optimizer.step()
                step += 1
        if evaluator.final(step=step):           # the final weights, unless just evaluated
            evaluate_shard(...)

    ``epoch`` is the number of epochs completed before this step (the 0-based index of the current
    epoch), so ``freq_epochs=1`` fires on the first step of each new epoch.

    Adaptive frequency: with ``control`` (a ``ControlListener``) and ``interval_bounds=(lo, hi)``,
    the latest ``set_eval_interval`` advice replaces ``freq_steps``, clamped to ``[lo, hi]`` (and
    turns the step trigger on if ``freq_steps`` was None). Without advice, ``freq_steps`` holds.

    ``clock`` (monotonic seconds) is injectable for tests; ``group`` is the torch.distributed
    process group to agree over (default: the world). When it agrees, ``should_evaluate`` is a
    collective: every rank must call it at the same steps.
    """

    def __init__(
        self,
        freq_steps: int | None = None,
        freq_secs: float | None = None,
        freq_epochs: int | None = None,
        eval_before_train: bool = False,
        *,
        control: IntervalAdvice | None = None,
        interval_bounds: tuple[int, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        group: Any = None,
    ):
        for name, value in (("freq_steps", freq_steps), ("freq_secs", freq_secs), ("freq_epochs", freq_epochs)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if control is not None and interval_bounds is None:
            raise ValueError("following set_eval_interval advice needs interval_bounds=(min_steps, max_steps)")
        if interval_bounds is not None and not 1 <= interval_bounds[0] <= interval_bounds[1]:
            raise ValueError(f"interval_bounds must be (lo, hi) with 1 <= lo <= hi, got {interval_bounds!r}")
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self.freq_epochs = freq_epochs
        self.eval_before_train = eval_before_train
        self.control = control
        self.interval_bounds = interval_bounds
        self.clock = clock
        self.group = group
        self.interval_steps = freq_steps  # what the step trigger uses now; advice may change it
        self.evaluations = 0
        self.last_triggers: tuple[str, ...] = ()  # why the latest firing fired
        self._last_step: int | None = None  # anchored at the first check, then at each step firing
        self._last_epoch: int | None = None
        self._seen_epoch: int | None = None  # the epoch of the latest check: a new one starts an epoch
        self._evaluated_at: int | None = None  # the step of the latest firing
        self._last_time = clock()

    def should_evaluate(self, *, step: int, epoch: int | None = None) -> bool:
        """True when an evaluation is due at ``step``; the firing is recorded, so act on it."""
        first_check = self._last_step is None  # of the run: a restored state has had checks
        if first_check:
            self._last_step = step
        if epoch is not None and self._last_epoch is None:
            self._last_epoch = epoch
        now = self.clock()
        interval = self._advised_interval()
        wants = {
            "before_train": self.eval_before_train and first_check,
            "steps": interval is not None and step - self._last_step >= interval,
            "secs": self.freq_secs is not None and now - self._last_time >= self.freq_secs,
            # Only where an epoch starts: the anchor may be far behind (a restored run that did not
            # use the epoch trigger before), and firing mid-epoch would evaluate at a random step.
            "epochs": self.freq_epochs is not None and epoch is not None and self._seen_epoch is not None
            and epoch != self._seen_epoch and epoch - self._last_epoch >= self.freq_epochs,
        }
        if epoch is not None:
            self._seen_epoch = epoch
        if self._needs_agreement():
            wants, interval = self._agree(wants, interval)
        self.interval_steps = interval
        if wants["steps"]:
            self._last_step = step
        if wants["secs"]:
            self._last_time = now
        if wants["epochs"]:
            self._last_epoch = epoch
        fired = tuple(name for name in TRIGGERS if wants[name])
        if fired:
            self.evaluations += 1
            self.last_triggers = fired
            self._evaluated_at = step
        return bool(fired)

    def final(self, *, step: int) -> bool:
        """After the last update: True unless the weights after ``step`` updates were just evaluated.

        The same answer on every rank (it depends only on agreed firings), so it needs no
        collective. A True is recorded like any firing (``last_triggers == ("final",)``).
        """
        if self._evaluated_at == step:
            return False
        self._evaluated_at = self._last_step = step
        self._last_time = self.clock()
        self.evaluations += 1
        self.last_triggers = ("final",)
        return True

    def _advised_interval(self) -> int | None:
        advice = self.control.eval_interval() if self.control is not None else None
        if advice is None or not math.isfinite(advice) or advice <= 0:
            return self.interval_steps
        lo, hi = self.interval_bounds
        return int(min(max(round(advice), lo), hi))

    def _needs_agreement(self) -> bool:
        if self.freq_secs is None and self.control is None:
            return False  # steps and epochs are the same on every rank: no collective needed
        dist = sys.modules.get("torch.distributed")  # never imported means never initialised
        return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _agree(self, wants: dict[str, bool], interval: int | None) -> tuple[dict[str, bool], int | None]:
        """Everyone adopts rank 0's decision (and its advised interval)."""
        import torch
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flags = [int(wants[name]) for name in TRIGGERS] + [-1 if interval is None else interval]
        tensor = torch.tensor(flags, dtype=torch.int64, device=device)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(tensor, src=src, group=self.group)
        decided = tensor.tolist()
        return {name: bool(v) for name, v in zip(TRIGGERS, decided)}, None if decided[-1] < 0 else decided[-1]

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able counters; the seconds since the last time-triggered firing replace the clock."""
        return {
            "version": _STATE_VERSION,
            "last_step": self._last_step,
            "last_epoch": self._last_epoch,
            "secs_since_last": self.clock() - self._last_time,
            "interval_steps": self.interval_steps,
            "evaluations": self.evaluations,
            "seen_epoch": self._seen_epoch,
            "evaluated_at": self._evaluated_at,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown Evaluator state version {state.get('version')!r} (this is {_STATE_VERSION})")
        self._last_step = state["last_step"]
        self._last_epoch = state["last_epoch"]
        self._last_time = self.clock() - float(state["secs_since_last"])
        if self.control is not None and state["interval_steps"] is not None:
            lo, hi = self.interval_bounds  # the advice in force before the restart, within today's bounds
            self.interval_steps = int(min(max(state["interval_steps"], lo), hi))
        self.evaluations = int(state["evaluations"])
        # Absent from states saved before they existed: then a resumed run waits for a new epoch.
        self._seen_epoch = state.get("seen_epoch")
        self._evaluated_at = state.get("evaluated_at")


def default_eval_id(step: int) -> str:
    """The id of the evaluation of the weights after ``step`` updates: a rerun of it dedups downstream."""
    return f"step-{step}"
