"""Alerts into Prometheus Alertmanager through its API, so its routing, grouping, silences and
inhibition apply to rankwatch's alerts.

Alertmanager's API takes a JSON array of alerts at ``/api/v2/alerts`` and forgets a firing alert
when its ``endsAt`` passes (``resolve_timeout`` after the last post when none is given). So, as
Prometheus does, this sink keeps the set of firing alerts, re-sends it every ``resend_s`` while
the conditions hold, and gives each post ``endsAt`` = now + 4 × ``resend_s``: a lost post or two
changes nothing, and a notifier that stopped lets its alerts end within that time. A resolve is
sent with the condition's real ``startsAt`` (its first firing) and ``endsAt`` (the resolve's time).
Every transition of one condition carries one label set (``alert_labels``), so a group that
grows from one rank to two updates the same alert, and its resolve ends it.

The firing set lives in memory; the notifier rebuilds it on start from the alerts before its
read position (``restore``), so a restarted notifier keeps re-sending what still fires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rankwatch.contract import Alert
from rankwatch.errors import RankwatchError
from rankwatch.sinks.webhook import Secret, WebhookSink, _rfc3339, alert_labels

log = logging.getLogger(__name__)

API_PATH = "/api/v2/alerts"


def api_url(url: str) -> str:
    """Alertmanager's base URL gets the alerts path; a URL with a path is taken as it is.

    >>> api_url("http://am:9093"), api_url("http://am:9093/"), api_url("https://am/custom/api/v2/alerts")
    ('http://am:9093/api/v2/alerts', 'http://am:9093/api/v2/alerts', 'https://am/custom/api/v2/alerts')
    """
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        parts = parts._replace(path=API_PATH)
    return urlunsplit(parts)


class AlertmanagerSink(WebhookSink):
    """POSTs alerts to Alertmanager's API and keeps the firing ones alive there (``tick``)."""

    def __init__(self, url: Secret, *, resend_s: float = 60.0, clock: Callable[[], float] = time.time,
                 **options: Any):
        if not resend_s > 0:
            raise ValueError(f"resend_s must be positive, got {resend_s!r}")
        super().__init__(Secret(api_url(url.reveal())), **options)
        self.resend_s, self.clock = resend_s, clock
        self.firing: dict[str, Alert] = {}  # condition key -> its latest firing alert
        self.started: dict[str, float] = {}  # condition key -> when this incident first fired
        self._sent_at: float | None = None  # the last post of the whole firing set

    def restore(self, alert: Alert) -> None:
        """Take an alert delivered by an earlier run into the firing set, without sending it."""
        self._apply(alert, self.firing, self.started)

    def write(self, batch: list[Alert]) -> None:
        # Applied to copies: the set changes only once Alertmanager took the post (a retry of a
        # resolve needs the start it removes).
        firing, started = dict(self.firing), dict(self.started)
        now = self.clock()
        postable = [self._postable(a, self._apply(a, firing, started), now) for a in batch]
        self.post(postable, len(postable))
        self.firing, self.started = firing, started

    def tick(self) -> None:
        """Re-send the firing set when ``resend_s`` has passed since it was last sent whole."""
        now = self.clock()
        if not self.firing or (self._sent_at is not None and now - self._sent_at < self.resend_s):
            return
        self._sent_at = now  # a failure waits for the next interval: the hold covers a few
        try:
            self.post([self._postable(a, self.started[k], now) for k, a in self.firing.items()], len(self.firing))
        except RankwatchError as exc:
            log.warning("re-sending %d firing alert(s) failed: %s; trying again in %.0f s",
                        len(self.firing), exc, self.resend_s)

    @staticmethod
    def _apply(a: Alert, firing: dict[str, Alert], started: dict[str, float]) -> float:
        """Update the firing set with ``a``; return when its incident started."""
        known = firing.get(a.key)
        start = started.get(a.key, a.ts) if known is not None and known.incident == a.incident else a.ts
        if a.status == "firing":
            firing[a.key], started[a.key] = a, start
        else:
            firing.pop(a.key, None)
            started.pop(a.key, None)
            start = min(start, a.ts)  # unknown start (fired before any record we have): the resolve's time
        return start

    def _postable(self, a: Alert, start: float, now: float) -> dict:
        """Alertmanager's PostableAlert for ``a``."""
        ends = a.ts if a.status == "resolved" else now + 4 * self.resend_s
        return {
            "labels": alert_labels(a),
            "annotations": {"summary": a.message, "ranks": ",".join(map(str, a.ranks)), "step": str(a.step),
                            "incident_step": str(a.incident)},
            "startsAt": _rfc3339(start),
            "endsAt": _rfc3339(ends),
        }
