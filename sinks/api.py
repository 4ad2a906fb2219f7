"""``rankwatch serve``: the report store over HTTP, read-only, as JSON; ``/metrics`` for Prometheus.

The stdlib's threading HTTP server: a few routes, no framework to install or patch. Each handler
thread opens its own connection to the store (a SQLite connection must not be shared between
threads). Bound to loopback by default; bound anywhere else it refuses to start without a bearer
token, and with one every request must carry ``Authorization: Bearer <token>``.

Routes (the OpenAPI document at ``/openapi.json`` lists them with their parameters):
``/runs``, ``/runs/{run}/metrics``, ``/runs/{run}/rollups``, ``/runs/{run}/eval-reports``,
``/runs/{run}/alerts``, ``/alerts/firing``, ``/metrics``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rankwatch.contract.codec import encode_tree
from rankwatch.errors import RankwatchError
from rankwatch.sinks.api_metrics import StoreCollector
from rankwatch.sinks.api_openapi import openapi
from rankwatch.sinks.eval_reports import as_json
from rankwatch.sinks.store import ReportStore
from rankwatch.sinks.store_query import Filters, Queries, parse_since, parse_steps

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReportAPI:
    """The routes as a pure mapping from (path, query) to (status, body); the HTTP layer is below."""

    def __init__(self, store_url: str, *, registry: CollectorRegistry | None = None, metrics_max_ranks: int = 64,
                 metrics_max_age_s: float = 86_400.0, rules: str = ""):
        self.store_url = store_url
        self.rules = rules  # a rules file for /runs/{run}/forecast; empty: the defaults
        self._local = threading.local()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(StoreCollector(self.queries, max_ranks=metrics_max_ranks, max_age_s=metrics_max_age_s))

    def queries(self) -> Queries:
        q = getattr(self._local, "queries", None)
        if q is None:
            q = self._local.queries = Queries(ReportStore(self.store_url).db)
        return q

    def get(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
        try:
            if parts == ["openapi.json"]:
                return _json(200, openapi())
            if parts == ["metrics"]:
                return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
            q = self.queries()
            if parts == ["runs"]:
                return _json(200, q.runs())
            if parts == ["alerts", "firing"]:
                return _json(200, q.firing())
            if len(parts) == 3 and parts[0] == "runs":
                run, what, f = parts[1], parts[2], _filters(query)
                if what == "metrics":
                    return _json(200, q.metrics(run))
                if what == "rollups":
                    return _json(200, q.rollups(run, f))
                if what == "eval-reports":
                    return _json(200, [as_json(r) for r in q.eval_reports(run, f)])
                if what == "alerts":
                    return _json(200, q.alerts(run, f))
                if what == "forecast":  # the trend of each eval and rule-watched metric (rankwatch.forecast)
                    from rankwatch.sinks.report_forecast import run_forecasts
                    from rankwatch.stream_processors.rules import Rules

                    return _json(200, run_forecasts(q, run, Rules.load(self.rules or None)))
            return _json(404, {"error": f"no such resource: {path} (see /openapi.json)"})
        except ValueError as exc:
            return _json(400, {"error": str(exc)})


def _filters(query: dict[str, list[str]]) -> Filters:
    def one(name):
        values = query.get(name)
        return values[-1] if values else None

    rank = one("rank")
    limit = one("limit")
    return Filters(
        metric=one("metric"),
        rank=None if rank is None else rank if rank == "all" else _int(rank, "rank"),
        steps=parse_steps(one("steps")) if one("steps") else (None, None),
        since=parse_since(one("since")) if one("since") else None,
        limit=None if limit is None else _int(limit, "limit"),
    )


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _json(status: int, body) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(encode_tree(body), allow_nan=False).encode()


def make_server(api: ReportAPI, host: str = "127.0.0.1", port: int = 8321, *,
                token: str | None = None) -> ThreadingHTTPServer:
    """A server for ``api`` (not yet serving). RankwatchError for a non-loopback address without a token."""
    if not is_loopback(host) and not token:
        raise RankwatchError(f"serving on {host} (not loopback) needs a bearer token: set RANKWATCH_API_TOKEN")

    class Handler(BaseHTTPRequestHandler):
        server_version = "rankwatch"

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if token and not hmac.compare_digest(self.headers.get("Authorization", "").encode(),
                                                 f"Bearer {token}".encode()):
                status, ctype, body = _json(401, {"error": "missing or wrong bearer token"})
            else:
                url = urlsplit(self.path)
                status, ctype, body = api.get(url.path, parse_qs(url.query))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            log.info("%s %s", self.address_string(), format % args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
