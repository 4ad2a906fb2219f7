"""HTTP webhook sink: plain JSON, Slack incoming-webhook, or Alertmanager webhook (v4) bodies.

The URL (Slack's carries its token) and an optional bearer token come from the environment and
are wrapped in ``Secret``, whose repr and str hide them, so neither reaches a log line or a
traceback. Delivery retries 5xx, 429 and connection errors with exponential backoff and jitter;
other 4xx are permanent (retrying a bad request cannot fix it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit

from rankwatch.contract import Alert
from rankwatch.errors import RankwatchError
from rankwatch.sinks.base import BatchingSink

log = logging.getLogger(__name__)
FORMATS = ("json", "slack", "alertmanager")


class Secret:
    """A string that never prints itself."""

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


class DeliveryError(RankwatchError):
    pass


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def slack_body(batch: list[Alert]) -> dict:
    icons = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}
    lines = [
        f"{':white_check_mark:' if a.status == 'resolved' else icons[a.severity]} *{a.status.upper()}* "
        f"[{a.severity}] `{a.run}` {a.detector}/{a.metric}: {a.message}"
        for a in batch
    ]
    return {"text": "\n".join(lines)}


def alertmanager_body(batch: list[Alert], receiver: str = "rankwatch") -> dict:
    """Alertmanager's webhook payload (version 4), so existing receivers of it work unchanged."""
    alerts = []
    for a in batch:
        labels = {"alertname": f"{a.detector}/{a.metric}", "run": a.run, "detector": a.detector,
                  "metric": a.metric, "severity": a.severity}
        if a.rank is not None:
            labels["rank"] = str(a.rank)
        alerts.append({
            "status": a.status,
            "labels": labels,
            "annotations": {"summary": a.message, "ranks": ",".join(map(str, a.ranks)), "step": str(a.step)},
            "startsAt": _rfc3339(a.ts) if a.status == "firing" else "0001-01-01T00:00:00Z",
            "endsAt": _rfc3339(a.ts) if a.status == "resolved" else "0001-01-01T00:00:00Z",
            "generatorURL": "",
            "fingerprint": hashlib.sha256(a.key.encode()).hexdigest()[:16],
        })
    status = "firing" if any(a.status == "firing" for a in batch) else "resolved"
    common = {k: v for k, v in alerts[0]["labels"].items() if all(x["labels"].get(k) == v for x in alerts)}
    return {
        "version": "4", "groupKey": "{}:" + json.dumps(common, sort_keys=True), "truncatedAlerts": 0,
        "status": status, "receiver": receiver, "groupLabels": {}, "commonLabels": common,
        "commonAnnotations": {}, "externalURL": "", "alerts": alerts,
    }


_BODIES: dict[str, Callable[[list[Alert]], dict]] = {
    "json": lambda batch: {"alerts": [a.to_dict() for a in batch]},
    "slack": slack_body,
    "alertmanager": alertmanager_body,
}


class WebhookSink(BatchingSink):
    def __init__(
        self,
        url: Secret,
        *,
        format: str = "json",
        token: Secret | None = None,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        timeout_s: float = 10.0,
        max_batch: int = 50,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        super().__init__(max_batch=max_batch)
        self.url, self.format, self.token = url, format, token
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.timeout_s, self._sleep = timeout_s, sleep
        parts = urlsplit(url.reveal())
        self.where = f"{parts.scheme}://{parts.hostname}"  # what logs may show: no path, no token

    def write(self, batch: list[Alert]) -> None:
        body = json.dumps(_BODIES[self.format](batch)).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "rankwatch"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token.reveal()}"
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url.reveal(), data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                return
            except urllib.error.HTTPError as exc:
                if exc.code < 500 and exc.code != 429:
                    raise DeliveryError(f"webhook {self.where} refused {len(batch)} alert(s): HTTP {exc.code}") from None
                why = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                why = type(getattr(exc, "reason", exc)).__name__
            if attempt == self.retries:
                raise DeliveryError(f"webhook {self.where} failed after {attempt + 1} attempts: {why}")
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("webhook %s: %s; retrying in %.1fs", self.where, why, delay)
            self._sleep(delay)
