"""Deliver alerts from ``rankwatch.alerts`` to sinks (terminal, JSONL file, webhook).

The reader keeps its place in a small JSON file, so a restarted notifier neither resends what it
delivered nor skips what arrived while it was down; redeliveries of one transition (same key,
status, incident and ranks) are dropped. The place never moves past an alert that was not
delivered: a sink that still fails after its own retries is tried again with backoff (for good
while following, ``attempts`` times with ``--once``); then the notifier stops before that alert,
says which one and why, and the next run starts with it. Delivery is at least once: with several
sinks, one that took the alert gets it again when another failed.

Sinks may have two more methods: ``tick()``, called after every poll of the topic (Alertmanager's
sink re-sends its firing alerts there), and ``restore(alert)``: before reading on, a notifier
with such a sink hands it every alert of the run before its read position, without delivering,
so state built from past alerts (the firing set) survives a restart.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rankwatch import contract
from rankwatch.contract import Alert
from rankwatch.errors import RankwatchError, SchemaError
from rankwatch.security import PLAINTEXT, KafkaSecurity
from rankwatch.sinks.base import Sink
from rankwatch.sinks.reader import read_topic

log = logging.getLogger(__name__)


@dataclass
class Notifier:
    sinks: list[Sink]
    run: str | None = None
    state_path: Path | None = None
    attempts: int = 3  # deliveries of one alert before a run that does not follow stops before it
    retry_s: float = 5.0  # the first wait between them; it doubles, up to ``max_retry_s``
    max_retry_s: float = 300.0
    sleep: Callable[[float], None] = time.sleep
    delivered: int = 0
    failed: int = 0
    error: str | None = None  # why the last delivery failed
    undelivered: str | None = None  # the alert a run stopped before, and why: the next run starts there
    _seen: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def handle(self, alert: Alert) -> bool:
        """Deliver one alert to every sink unless filtered or already delivered; True if delivered.

        False also when a sink failed; then ``error`` says why, and the alert is not remembered
        as delivered (a retry sends it).
        """
        self.error = None
        if self.run is not None and alert.run != self.run:
            return False
        identity = (alert.key, alert.status, alert.incident, alert.ranks)
        if identity in self._seen:
            return False
        errors = []
        for sink in self.sinks:
            try:
                sink.add(alert)
                sink.flush()
            except RankwatchError as exc:
                errors.append(f"{type(sink).__name__}: {exc}")
                log.error("%s could not deliver %s: %s", type(sink).__name__, alert.key, exc)
        if errors:
            self.error = "; ".join(errors)
            return False
        self._seen[identity] = None
        if len(self._seen) > 10_000:
            self._seen.popitem(last=False)
        self.delivered += 1
        return True

    def follow(self, bootstrap: str, *, follow: bool = True, from_beginning: bool = False,
               stop: Callable[[], bool] | None = None, security: KafkaSecurity = PLAINTEXT) -> None:
        offsets = self._load_offsets()
        if any(hasattr(sink, "restore") for sink in self.sinks):
            offsets = self._restore(bootstrap, offsets, from_beginning, security)
        records = read_topic(bootstrap, contract.ALERTS, follow=follow, from_beginning=from_beginning,
                             offsets=offsets, stop=stop, on_poll=self._tick, security=security)
        try:
            for record in records:
                try:
                    alert = Alert.from_bytes(record.value)
                except SchemaError as exc:
                    log.warning("skipping an undecodable alert at %d@%d: %s", record.partition, record.offset, exc)
                else:
                    if not self._deliver(alert, forever=follow, stop=stop):
                        # The position stays before it: the next run sends it first.
                        self.failed += 1
                        self.undelivered = f"{alert.key} ({alert.status}, step {alert.step}): {self.error}"
                        log.error("not delivered: %s; stopped before it (partition %d, offset %d), "
                                  "the next run sends it", self.undelivered, record.partition, record.offset)
                        return
                offsets[record.partition] = record.offset + 1
                self._save_offsets(offsets)
        finally:
            records.close()
            self._save_offsets(offsets)

    def _restore(self, bootstrap: str, offsets: dict[int, int], from_beginning: bool,
                 security: KafkaSecurity = PLAINTEXT) -> dict[int, int]:
        """Hand the sinks that keep state the alerts before the read position; return the position.

        A partition without a saved position starts at its beginning (nothing before it) or, when
        reading from the end, where this pass stopped, so that nothing falls between the two.
        """
        start = dict(offsets)
        for record in read_topic(bootstrap, contract.ALERTS, follow=False, from_beginning=True, security=security):
            saved = offsets.get(record.partition)
            if saved is None and from_beginning or saved is not None and record.offset >= saved:
                continue
            if saved is None:
                start[record.partition] = record.offset + 1
            try:
                alert = Alert.from_bytes(record.value)
            except SchemaError:
                continue  # said when it is delivered (or was)
            if self.run is None or alert.run == self.run:
                for sink in self.sinks:
                    if hasattr(sink, "restore"):
                        sink.restore(alert)
        return start

    def _tick(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "tick"):
                sink.tick()

    def _deliver(self, alert: Alert, *, forever: bool, stop: Callable[[], bool] | None) -> bool:
        """Deliver with retries and backoff; True once delivered (or nothing to deliver)."""
        for attempt in itertools.count():
            if self.handle(alert) or self.error is None:
                return True
            if (not forever and attempt + 1 >= self.attempts) or (stop is not None and stop()):
                return False
            delay = min(self.max_retry_s, self.retry_s * 2**attempt)
            log.warning("retrying %s in %.0f s", alert.key, delay)
            waited = 0.0
            while waited < delay and not (stop is not None and stop()):  # Ctrl-C is heard within 0.5 s
                self.sleep(min(0.5, delay - waited))
                waited += 0.5
        return False

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
