"""How many training steps apart ``TrainerHook`` measures gradient statistics, chosen from their cost.

Measuring a step (gathering its gradients for the sender thread, the learning rate, the weight
statistics, and the bookkeeping only measured steps need) runs some Python on the training thread
right after the optimizer, when the caches are cold: tens of µs, little on a 25 ms step but
several percent of a 1 ms one (``bench/step_cost.py``). So on fast loops the hook measures every
few steps, while every step still publishes its loss, the loop's metrics and its times. Strides
are powers of two and measured steps their multiples, so ranks with the same stride, or strides a
power of two apart, measure the same steps.
"""

from __future__ import annotations

#: The share of the training thread's time that measuring may take, as the hook times it. Its
#: indirect costs (caches, the GIL the sender thread holds meanwhile) take about as much again.
COST_BUDGET = 0.002
MAX_EVERY = 64  # the most steps from one measured step to the next
MAX_GAP_S = 0.2  # ... and the longest between two of them; the stride grows only while half this holds


class Stride:
    """Chooses the stride from each measured step's cost and the step time, with some damping.

    >>> stride = Stride()
    >>> stride.update(cost_s=100e-6, step_s=1e-3)  # 10% of a step: over 64 steps, 0.16%
    64
    >>> stride.update(cost_s=100e-6, step_s=50e-3)  # 0.2%: every step
    1
    """

    def __init__(self) -> None:
        self.every = 1
        self.cost_s: float | None = None  # a moving average: one slow step (a GC pause) moves it little

    def update(self, cost_s: float, step_s: float) -> int:
        """The stride after a measured step whose measuring cost ``cost_s`` of a ``step_s``-long step."""
        self.cost_s = cost_s if self.cost_s is None else self.cost_s + 0.2 * (cost_s - self.cost_s)
        need, every = self.cost_s / (COST_BUDGET * max(step_s, 1e-9)), 1
        while every < need and every < MAX_EVERY and 4 * every * step_s <= MAX_GAP_S:
            every *= 2
        # Down only with a margin, so a cost near a boundary does not flip the stride back and forth
        # (unless the steps grew so long that the stride now waits too long between points).
        if every >= self.every or need * 1.5 <= every or self.every * step_s > MAX_GAP_S:
            self.every = every
        return self.every
