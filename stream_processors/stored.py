"""Reading state that a worker stored in a changelog, which another release may have written.

Workers of two releases can share a consumer group (a rolling upgrade, a rollback). Each kind of
stored state carries a layout version; ``read`` hands a state of this worker's version to its reader
and raises the kind's own error for anything else, or for fields the reader does not take (a newer
release's detector parameter), so that no state is ever misread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: What a reader raises when a stored layout does not fit it (a missing or unexpected field, a bad value).
_MISFITS = (KeyError, TypeError, ValueError, AttributeError)


def read(d: Any, read_fields: Callable[[dict], T], *, version: int, what: str, error: type[Exception],
         unversioned: int | None = 1) -> T:
    """``read_fields(d without its version)`` if ``d`` is a dict of ``version``; else ``error``.

    ``unversioned``: the version of a state stored before its kind had versions (None: refused).
    """
    found = d.get("version", unversioned) if isinstance(d, dict) else None
    if found != version:
        raise error(f"stored {what} has version {found!r}; this worker reads version {version} only")
    try:
        return read_fields({k: v for k, v in d.items() if k != "version"})
    except _MISFITS as exc:
        raise error(f"stored {what} does not fit this worker: {type(exc).__name__}: {exc}") from None
