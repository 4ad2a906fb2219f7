"""A training step's published metrics, worked out from the facts ``TrainerHook.end_step`` took.

``end_step`` runs right after the optimizer, when the CPU caches are cold, and there every line of
Python costs microseconds (``bench/step_cost.py``). So it only notes what cannot wait: when the step
ended, its losses and metrics, and the waits it measured. ``StepPoint`` turns these into the point's
metrics (the mean loss, ``step_time_s``, the rates, ``compute_time_s``) on the publisher's sender
thread (``RankPublisher.defer``), in step order.
"""

from __future__ import annotations

import math
from typing import Any

from rankwatch.producers.collectives import Remainder
from rankwatch.producers.values import Derived

_NO_FACTS: dict[str, Any] = {}


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


class StepPoint:
    """Called once per step, in order, with the step's facts; returns ``(step, metrics)``.

    Facts: ``ended`` (``time.perf_counter()`` at the step's end), ``losses`` (one per micro-batch),
    ``metrics`` (the loop's own, or None), and ``facts`` (None, or a dict with any of ``skipped``,
    ``samples`` and ``tokens`` (lists of per-micro-batch counts), ``data_wait_s`` and
    ``collective_time_s``).

    >>> point = StepPoint(samples_per_step=32)
    >>> point(0, 10.0, [2.0], None, None)
    (0, {'loss': 2.0})
    >>> point(1, 10.5, [1.0], {"acc": 0.5}, {"data_wait_s": 0.125})
    (1, {'acc': 0.5, 'loss': 1.0, 'step_time_s': 0.5, 'samples_per_s': 64.0, 'data_wait_s': 0.125, 'compute_time_s': 0.375})
    """

    def __init__(self, samples_per_step: int | None = None, tokens_per_step: int | None = None):
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self._last_end: float | None = None

    def __call__(self, step: int, ended: float, losses: list[Any], metrics: dict[str, Any] | None,
                 facts: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        point = {} if metrics is None else metrics  # handed over by the hook: it is ours now
        facts = facts or _NO_FACTS
        if losses:
            point["loss"] = losses[0] if len(losses) == 1 else Derived(_mean, losses)
        if (skipped := facts.get("skipped")) is not None:
            point["step_skipped"] = skipped
        last, self._last_end = self._last_end, ended
        if last is not None:
            elapsed = point["step_time_s"] = ended - last
            self._rate(point, "samples_per_s", facts.get("samples"), self.samples_per_step, elapsed)
            self._rate(point, "tokens_per_s", facts.get("tokens"), self.tokens_per_step, elapsed)
        waited = collective = 0.0
        if "data_wait_s" in facts:
            point["data_wait_s"] = waited = facts["data_wait_s"]
        if "collective_time_s" in facts:
            point["collective_time_s"] = collective = facts["collective_time_s"]
        if last is not None:
            left = elapsed - waited
            point["compute_time_s"] = (max(0.0, left - collective) if isinstance(collective, float)
                                       else Remainder(left, collective))
        return step, point

    @staticmethod
    def _rate(point: dict[str, Any], name: str, counts: list[Any] | None, per_step: int | None,
              elapsed: float) -> None:
        if counts:  # ints or tensors, one per micro-batch
            point[name] = Derived(lambda v: math.fsum(v) / elapsed, counts)
        elif per_step is not None:
            point[name] = per_step / elapsed
