"""Deliver alerts from ``rankwatch.alerts`` to sinks (terminal, JSONL file, webhook).

The reader keeps its place in a small JSON file, so a restarted notifier neither resends what it
delivered nor skips what arrived while it was down; redeliveries of one transition (same key,
status, incident and ranks) are dropped. A sink that still fails after its own retries is logged
and counted, and the alert stays on the topic for any other consumer.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rankwatch import contract
from rankwatch.contract import Alert
from rankwatch.errors import RankwatchError, SchemaError
from rankwatch.sinks.base import Sink
from rankwatch.sinks.reader import read_topic

log = logging.getLogger(__name__)


@dataclass
class Notifier:
    sinks: list[Sink]
    run: str | None = None
    state_path: Path | None = None
    delivered: int = 0
    failed: int = 0
    _seen: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def handle(self, alert: Alert) -> bool:
        """Deliver one alert to every sink unless filtered or already delivered; True if delivered."""
        if self.run is not None and alert.run != self.run:
            return False
        identity = (alert.key, alert.status, alert.incident, alert.ranks)
        if identity in self._seen:
            return False
        self._seen[identity] = None
        if len(self._seen) > 10_000:
            self._seen.popitem(last=False)
        ok = True
        for sink in self.sinks:
            try:
                sink.add(alert)
                sink.flush()
            except RankwatchError as exc:
                ok = False
                log.error("%s could not deliver %s: %s", type(sink).__name__, alert.key, exc)
        self.delivered += ok
        self.failed += not ok
        return ok

    def follow(self, bootstrap: str, *, follow: bool = True, from_beginning: bool = False,
               stop: Callable[[], bool] | None = None) -> None:
        offsets = self._load_offsets()
        try:
            for record in read_topic(bootstrap, contract.ALERTS, follow=follow,
                                     from_beginning=from_beginning, offsets=offsets, stop=stop):
                try:
                    self.handle(Alert.from_bytes(record.value))
                except SchemaError as exc:
                    log.warning("skipping an undecodable alert at %d@%d: %s", record.partition, record.offset, exc)
                offsets[record.partition] = record.offset + 1
                self._save_offsets(offsets)
        finally:
            self._save_offsets(offsets)

    def _load_offsets(self) -> dict[int, int]:
        if self.state_path is None or not self.state_path.exists():
            return {}
        return {int(p): o for p, o in json.loads(self.state_path.read_text()).items()}

    def _save_offsets(self, offsets: dict[int, int]) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(offsets))
        tmp.replace(self.state_path)  # atomic: a crash leaves the old or the new file, never half
