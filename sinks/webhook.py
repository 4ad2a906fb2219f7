"""HTTP webhook sink: plain JSON, Slack incoming-webhook, or Alertmanager's webhook-receiver (v4) bodies.

Sending alerts *to* Alertmanager (its ``/api/v2/alerts``) is ``sinks/alertmanager.py``:
``--format alertmanager`` (also spelled ``alertmanager-api``). ``alertmanager-webhook`` is the
payload Alertmanager itself sends to its webhook receivers, for tools built to receive that.

The URL (Slack's carries its token) and an optional bearer token come from the environment and
are wrapped in ``Secret``, whose repr and str hide them, so neither reaches a log line or a
traceback. Delivery retries 5xx, 429 and connection errors with exponential backoff and jitter
(after a 429, as long as its ``Retry-After`` says); other 4xx are permanent (retrying a bad request
cannot fix it). Slack bodies escape what comes from data and stay under Slack's length limit.
"""

from __future__ import annotations

import email.utils
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
FORMATS = ("json", "slack", "alertmanager-webhook")  # this sink's; ALL_FORMATS adds Alertmanager's API
ALERTMANAGER_API = ("alertmanager", "alertmanager-api")  # the same: users expect "alertmanager" to reach it
ALL_FORMATS = (*FORMATS, *ALERTMANAGER_API)


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


SLACK_FIELD_MAX = 300  # characters of one name (run, detector, metric, severity) in a Slack line
SLACK_MESSAGE_MAX = 2000  # characters of an alert's message
SLACK_TEXT_MAX = 39_000  # Slack cuts a message's text at 40,000 characters, silently
TRUNCATED = "…[truncated]"


def slack_text(value: object, limit: int = SLACK_FIELD_MAX) -> str:
    """Data made safe for Slack's mrkdwn: capped with a marker, then ``&``, ``<``, ``>`` escaped
    (unescaped, ``<http://…|click here>`` in a run or metric name would become a link).

    >>> slack_text("reward<http://evil.example|click here> & more")
    'reward&lt;http://evil.example|click here&gt; &amp; more'
    >>> slack_text("x" * 20, limit=8)
    'xxxxxxxx…[truncated]'
    """
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + TRUNCATED
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_body(batch: list[Alert]) -> dict:
    icons = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}
    lines, size = [], 0
    for i, a in enumerate(batch):
        icon = ":white_check_mark:" if a.status == "resolved" else icons.get(a.severity, ":warning:")
        line = (f"{icon} *{slack_text(a.status.upper())}* [{slack_text(a.severity)}] `{slack_text(a.run)}` "
                f"{slack_text(a.detector)}/{slack_text(a.metric)}: {slack_text(a.message, SLACK_MESSAGE_MAX)}")
        if size + len(line) + 1 > SLACK_TEXT_MAX - 100:  # room for the line that says what is left out
            lines.append(f"…[truncated: {len(batch) - i} more alert(s) not shown]")
            break
        lines.append(line)
        size += len(line) + 1
    return {"text": "\n".join(lines)}


def alert_labels(a: Alert) -> dict[str, str]:
    """One label set per condition, the same for its firing, its growth and its resolve: the ranks
    involved change while it fires, so they go in annotations. A condition that is per rank by its
    key (``run/detector/metric/rank``) keeps that rank as a label.

    >>> from rankwatch.contract import Alert
    >>> a = Alert(key="r/nonfinite/loss", run="r", status="firing", severity="critical", detector="nonfinite",
    ...           metric="loss", rank=3, step=5, value=1.0, message="", ts=0.0, ranks=(3,))
    >>> alert_labels(a)
    {'alertname': 'nonfinite/loss', 'run': 'r', 'detector': 'nonfinite', 'metric': 'loss', 'severity': 'critical'}
    """
    labels = {"alertname": f"{a.detector}/{a.metric}", "run": a.run, "detector": a.detector,
              "metric": a.metric, "severity": a.severity}
    if a.rank is not None and a.key == Alert.make_key(a.run, a.detector, a.metric, a.rank):
        labels["rank"] = str(a.rank)
    return labels


def alertmanager_webhook_body(batch: list[Alert], receiver: str = "rankwatch") -> dict:
    """The payload Alertmanager sends its webhook receivers (version 4), for tools that read it.

    Not what Alertmanager's API accepts (that is ``sinks/alertmanager.py``). Without a firing
    set, a resolved alert's start is unknown here: ``startsAt`` is then the zero time.
    """
    alerts = []
    for a in batch:
        labels = alert_labels(a)
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
    notes = {k: v for k, v in alerts[0]["annotations"].items()
             if all(x["annotations"].get(k) == v for x in alerts)}
    return {
        "version": "4", "groupKey": "{}:" + json.dumps(common, sort_keys=True), "truncatedAlerts": 0,
        "status": status, "receiver": receiver, "groupLabels": common, "commonLabels": common,
        "commonAnnotations": notes, "externalURL": "", "alerts": alerts,
    }


_BODIES: dict[str, Callable[[list[Alert]], dict]] = {
    "json": lambda batch: {"alerts": [a.to_dict() for a in batch]},
    "slack": slack_body,
    "alertmanager-webhook": alertmanager_webhook_body,
}


def retry_after(value: str | None, *, now: Callable[[], float] = time.time) -> float | None:
    """Seconds to wait from an HTTP ``Retry-After`` (seconds or a date), at most 15 minutes; None if absent or unreadable.

    >>> retry_after("7"), retry_after(None), retry_after("soon")
    (7.0, None, None)
    >>> retry_after("Thu, 01 Jan 1970 00:00:30 GMT", now=lambda: 0.0)
    30.0
    """
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - now()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), 900.0)


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
            hint = "; Alertmanager's API is AlertmanagerSink's" if format in ALERTMANAGER_API else ""
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}{hint}")
        super().__init__(max_batch=max_batch)
        self.url, self.format, self.token = url, format, token
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.timeout_s, self._sleep = timeout_s, sleep
        parts = urlsplit(url.reveal())
        self.where = f"{parts.scheme}://{parts.hostname}"  # what logs may show: no path, no token

    def write(self, batch: list[Alert]) -> None:
        self.post(_BODIES[self.format](batch), len(batch))

    def post(self, payload: object, count: int) -> None:
        """POST ``payload`` as JSON with the retries above; raise ``DeliveryError`` if it is not taken."""
        body = json.dumps(payload).encode()
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
                    said = exc.read(300).decode("utf-8", "replace").strip()  # e.g. Alertmanager's reason
                    raise DeliveryError(f"webhook {self.where} refused {count} alert(s): HTTP {exc.code}"
                                        + (f" ({said})" if said else "")) from None
                why = f"HTTP {exc.code}"
                wait = retry_after(exc.headers.get("Retry-After")) if exc.code == 429 else None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                why, wait = type(getattr(exc, "reason", exc)).__name__, None
            if attempt == self.retries:
                raise DeliveryError(f"webhook {self.where} failed after {attempt + 1} attempts: {why}")
            if wait is not None:  # the receiver said when (Slack's rate limit does): sooner is refused again
                delay = wait
            else:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("webhook %s: %s; retrying in %.1fs", self.where, why, delay)
            self._sleep(delay)
