from __future__ import annotations

import json
from pathlib import Path

from rankwatch.contract import Alert
from rankwatch.sinks.base import BatchingSink


class JsonlSink(BatchingSink):
    """Appends each alert as one JSON line (the wire form) to a file, e.g. for ``jq`` or log shipping."""

    def __init__(self, path: str | Path, *, max_batch: int = 100):
        super().__init__(max_batch=max_batch)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, batch: list[Alert]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(a.to_dict()) + "\n" for a in batch)
