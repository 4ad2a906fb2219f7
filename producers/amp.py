"""Mixed precision: a step that uses ``torch.amp.GradScaler`` ends at ``scaler.update()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def after_scaler_update(scaler: Any, optimizer: Any, end_step: Callable[..., None]) -> Callable[[], None]:
    """Call ``end_step(skipped=n)`` after every ``scaler.update()``; returns what undoes it.

    ``n`` is the number of devices where the scaler found an Inf or NaN, in which case
    ``scaler.step()`` skipped ``optimizer.step()`` (and with it every optimizer hook); None when
    the scaler keeps no such state for ``optimizer``.
    """
    original = scaler.update

    def update(new_scale=None):
        try:  # read before update() forgets it
            found = scaler._found_inf_per_device(optimizer)
            skipped = sum(found.values()) if found else None
        except (AttributeError, KeyError):
            skipped = None
        original(new_scale)
        end_step(skipped=skipped)

    scaler.update = update  # on the instance: deleting it brings back the class's method
    return lambda: delattr(scaler, "update")
