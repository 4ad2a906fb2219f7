"""Trainer adapters: rankwatch as a callback of the trainer a user already has.

- ``rankwatch.producers.adapters.huggingface.RankwatchCallback``: a ``transformers.TrainerCallback``;
- ``rankwatch.producers.adapters.lightning.RankwatchCallback``: a Lightning ``Callback``.

Each module imports its library when it is imported itself, so neither library is needed to use
the rest of rankwatch. Both drive a ``TrainerHook`` (``attach=False``) from the trainer's own events
and create a ``RankPublisher.from_env()`` when none is given.

A monitoring hook must never stop training: each callback entry point catches what rankwatch
raises, logs one warning with the traceback, and switches monitoring off for the rest of the run.
A missing run id is not an error either: it is derived (``derive_run``) with one warning.

Both take an optional ``Evaluator`` (``evaluator=``): it decides after each optimizer step whether
the weights are evaluated, and at the end of training ``Evaluator.final`` makes sure the final
weights are (periodic triggers alone stop short). The evaluation itself is the trainer's own
(Hugging Face: Trainer's ``evaluate`` on its ``eval_dataset``, whose ``eval_*`` logs are published)
or a function ``evaluate(step)`` the user gives (required under Lightning, which cannot start its
validation loop from a callback).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from rankwatch.producers.publisher import RankPublisher

__all__ = ["EvaluationSchedule", "batch_size", "derive_run", "guarded", "publisher_from_env", "release"]

log = logging.getLogger(__name__)


def derive_run(trainer_name: str | None = None, *, now: Callable[[], float] = time.time) -> str:
    """A run id when the environment gives none: the trainer's run name, else a timestamp.

    Every rank must publish under the same id, so under torch.distributed rank 0's choice is
    broadcast (all ranks reach the callback's start together, as they do any collective).

    >>> derive_run("my-run")
    'my-run'
    >>> derive_run(now=lambda: 0.0)
    'run-19700101-000000'
    """
    run = trainer_name or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime(now()))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        chosen = [run]
        dist.broadcast_object_list(chosen, src=0)
        run = chosen[0]
    return run


def publisher_from_env(trainer_name: str | None = None, **identity: Any) -> RankPublisher:
    """``RankPublisher.from_env()``; without ``RANKWATCH_RUN`` (or torchrun's id), a derived run id."""
    # The adapters are where a trainer's process enters rankwatch, so the environment is read here.
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if os.environ.get("RANKWATCH_RUN") or elastic not in ("", "none"):
        return RankPublisher.from_env(**identity)
    run = derive_run(trainer_name)
    log.warning("rankwatch: RANKWATCH_RUN is not set; publishing as run %r "
                "(set RANKWATCH_RUN, the same on every rank, to name the run)", run)
    return RankPublisher.from_env(run=run, **identity)


def guarded(method: Callable) -> Callable:
    """A callback entry point that never raises: a failure is logged once and monitoring stops.

    The callback's ``_switch_off()`` lets go of what it holds; training goes on untouched.
    """

    @functools.wraps(method)
    def entry(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_off", False):
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception:
            self._off = True
            log.warning("rankwatch: %s.%s failed; monitoring is off for the rest of this run, training goes on",
                        type(self).__name__, method.__name__, exc_info=True)
            try:
                self._switch_off()
            except Exception:  # already broken: nothing more to tell
                log.debug("rankwatch: switching off failed too", exc_info=True)
            return None

    return entry


class EvaluationSchedule:
    """An ``Evaluator`` asked at each optimizer step and once at the end; ``run(step)`` evaluates.

    Kept apart from monitoring: a failing publisher does not stop the user's evaluations. A
    failure of the schedule itself (e.g. its broadcast) is logged once and ends the schedule.
    """

    def __init__(self, evaluator: Any, run: Callable[[int], Any] | None):
        self.evaluator, self.run = evaluator, run

    def after_step(self, step: int, epoch: int | None, *, last: bool = False) -> bool:
        """True when the weights after ``step`` updates are due (``last``: the final ones); ``run`` is called then."""
        return self._ask(lambda ev: ev.should_evaluate(step=step, epoch=epoch) | (last and ev.final(step=step)), step)

    def at_end(self, step: int) -> bool:
        return self._ask(lambda ev: ev.final(step=step), step)

    def _ask(self, decide: Callable[[Any], bool], step: int) -> bool:
        if self.evaluator is None:
            return False
        try:
            due = bool(decide(self.evaluator))
        except Exception:
            self.evaluator = None
            log.warning("rankwatch: the evaluation schedule failed; no more evaluations are scheduled, training goes on",
                        exc_info=True)
            return False
        if due and self.run is not None:
            self.run(step)
        return due


def release(hook: Any, publisher: Any, owns_publisher: bool) -> None:
    """End of training: detach the hook; close a publisher we made, flush one the user gave us."""
    if hook is not None:
        hook.detach()
    if publisher is not None:
        if owns_publisher:
            publisher.close()
        else:
            publisher.flush()


def batch_size(batch: Any) -> int | None:
    """Leading dimension of the first tensor in a (nested) batch; None when there is none.

    >>> import numpy as np
    >>> batch_size({"input_ids": np.zeros((4, 7)), "labels": np.zeros(4)})
    4
    """
    if hasattr(batch, "shape") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size(item)
            if size is not None:
                return size
    return None
