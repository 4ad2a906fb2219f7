"""A throwaway data dir for a bench's broker and workers, removed when the bench exits (Ctrl-C
included): a 30-minute soak on Apache Kafka writes about 10 GB there."""

from __future__ import annotations

import atexit
import shutil
import tempfile


def scratch_dir(bench: str) -> str:
    path = tempfile.mkdtemp(prefix=f"rankwatch-{bench}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
