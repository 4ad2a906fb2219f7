"""A training step's published metrics, worked out from the facts ``TrainerHook.end_step`` took.

``end_step`` runs right after the optimizer, when the CPU caches are cold, and there every line of
Python costs microseconds (``bench/step_cost.py``). So it only notes what cannot wait: when the step
ended, its losses and metrics, and the waits it measured. ``StepPoint`` turns these into the point's
metrics (the mean loss, ``step_time_s``, the rates, ``compute_time_s``, ``cpu_wait_s``) on the
publisher's sender thread (``RankPublisher.defer``), in step order.

``compute_time_s`` is the step less its waits: for the next batch, for peers in collectives, and
for a CPU. The last one is there because on a host with more runnable threads than cores (ranks
sharing a machine, a busy data loader, a neighbour's job) the scheduler leaves one rank's thread
waiting for several steps running, and that rank then looked like a straggler although nothing in it
was slow; its ``cpu_wait_s`` says so instead. Only the CPU wait outside the other two counts: much of
a DDP step's computing overlaps its all-reduce, whose time is out already, and taking the whole wait
out as well counted that overlap twice (on the demo's over-full host, half its steps came out at 0).
So the hook also reads the thread's wait clock where collectives start and end and around each
batch's wait. A rank that makes its peers wait is still named by their ``collective_time_s``,
whatever made it slow.
"""

from __future__ import annotations

import math
from typing import Any

from rankwatch.contract import CPU_WAIT
from rankwatch.producers.collectives import Remainder
from rankwatch.producers.system import run_delay_s
from rankwatch.producers.values import Derived

_NO_FACTS: dict[str, Any] = {}


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


class StepPoint:
    """Called once per step, in order, with the step's facts; returns ``(step, metrics)``.

    Facts: ``ended`` (``time.perf_counter()`` at the step's end), ``losses`` (one per micro-batch),
    ``metrics`` (the loop's own, or None), and ``facts`` (None, or a dict with any of ``skipped``,
    ``samples`` and ``tokens`` (lists of per-micro-batch counts), ``data_wait_s``,
    ``collective_time_s``, ``cpu_clock`` (a ``CpuWaitClock`` reading at the step's end) and
    ``cpu_wait_inside_s`` (how much of the step's CPU wait fell inside the data and collective waits)).

    >>> point = StepPoint(samples_per_step=32)
    >>> point(0, 10.0, [2.0], None, None)
    (0, {'loss': 2.0})
    >>> point(1, 10.5, [1.0], {"acc": 0.5}, {"data_wait_s": 0.125})
    (1, {'acc': 0.5, 'loss': 1.0, 'step_time_s': 0.5, 'samples_per_s': 64.0, 'data_wait_s': 0.125, 'compute_time_s': 0.375})
    >>> point(2, 11.0, [1.0], None, {"cpu_clock": b"0 1000000000 1"})  # no earlier reading: no wait yet
    (2, {'loss': 1.0, 'step_time_s': 0.5, 'samples_per_s': 64.0, 'compute_time_s': 0.5})
    >>> facts = {"cpu_clock": b"0 1250000000 2", "collective_time_s": 0.125, "cpu_wait_inside_s": 0.125}
    >>> _, metrics = point(3, 11.5, [1.0], None, facts)  # 0.25 s waiting for a CPU, half in the all-reduce
    >>> metrics["cpu_wait_s"], metrics["compute_time_s"]
    (0.25, 0.25)
    """

    def __init__(self, samples_per_step: int | None = None, tokens_per_step: int | None = None):
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self._last_end: float | None = None
        self._last_delay: float | None = None  # the thread's run delay at the last step's end

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
        if (clock := facts.get("cpu_clock")) is not None:
            delay, before = run_delay_s(clock), self._last_delay
            self._last_delay = delay
            if delay is not None and before is not None and last is not None:
                point[CPU_WAIT] = cpu_wait = max(0.0, delay - before)
                waited += max(0.0, cpu_wait - facts.get("cpu_wait_inside_s", 0.0))
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
