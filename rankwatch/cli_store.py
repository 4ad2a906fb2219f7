"""The report store's subcommands: ``store`` (fill it), ``report`` and ``runs`` (query it), ``serve`` (HTTP).

Kept out of ``cli.py`` so each file stays about one concern; ``cli.build_parser`` calls ``add_commands``.
The query commands read only the store, so they answer with the broker stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

from rankwatch import cli_report
from rankwatch.contract.codec import encode_tree
from rankwatch.errors import RankwatchError
from rankwatch.settings import Settings

READY_LINE = "rankwatch store ready"  # the Stack waits for it (rankwatch.stack.STORE_READY_LINE)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(bootstrap=getattr(args, "bootstrap", None), store_url=getattr(args, "store", None))


def _open_for_reading(settings: Settings):
    """The store's queries; a clear error when there is no store yet (instead of creating an empty one)."""
    from rankwatch.sinks.store import ReportStore, store_url
    from rankwatch.sinks.store_query import Queries

    url = store_url(settings)
    if not url.startswith(("postgresql://", "postgres://")) and not Path(url.removeprefix("sqlite:///")).exists():
        raise RankwatchError(f"no report store at {url}: `rankwatch up` or `rankwatch store` fills it "
                             "(set RANKWATCH_DATA_DIR or RANKWATCH_STORE_URL to use another)")
    return Queries(ReportStore(url).db)


def cmd_store(args: argparse.Namespace) -> int:
    import signal
    import threading

    from rankwatch.cli_common import like_ctrl_c, until_ctrl_c
    from rankwatch.sinks.store import ReportStore, store_url
    from rankwatch.sinks.store_sink import StoreSink
    from rankwatch.stack import PARENT_ENV

    settings = _settings(args)
    store = ReportStore(store_url(settings))
    parent = os.environ.get(PARENT_ENV)
    orphaned = (lambda: os.getppid() != int(parent)) if parent else (lambda: False)  # a killed Stack
    print(f"{READY_LINE}: {settings.bootstrap} -> {store_url(settings)}", flush=True)
    sink = StoreSink(store, settings.bootstrap, from_beginning=args.from_beginning)
    sink.security = settings.security  # SASL/TLS of its consumer
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, like_ctrl_c)  # a Stack stops us with SIGTERM: finish the batch first
    try:
        with until_ctrl_c() as pressed:
            # Stopped (Ctrl-C, or a Stack's SIGTERM after its workers): store what they sent last, 10 s at most.
            sink.run(follow=not args.once, stop=lambda: pressed() or orphaned(), drain_s=10.0)
    finally:
        store.close()
    print(f"stored {sink.written} messages", file=sys.stderr)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    import time

    from rankwatch.sinks.store import PRUNED_TABLES, ReportStore, store_url

    if not args.older_than >= 0:
        raise RankwatchError(f"--older-than takes days, 0 or more; got {args.older_than:g}")
    settings = _settings(args)
    _open_for_reading(settings)  # no store: say so rather than create an empty one
    before = time.time() - args.older_than * 86_400
    store = ReportStore(store_url(settings))
    try:
        result = store.prune(before, dry_run=args.dry_run)
    finally:
        store.close()
    for run, last_ts in result.runs:
        print(f"{run}  last active {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(last_ts))}")
    counts = ", ".join(f"{result.rows[t]:,} {t.replace('_', ' ')}" for t in PRUNED_TABLES)
    print(f"{'would prune' if args.dry_run else 'pruned'} {len(result.runs)} run(s) last active more than "
          f"{args.older_than:g} day(s) ago: {counts}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rankwatch.sinks.eval_reports import as_json, format_table
    from rankwatch.sinks.store_query import Filters, parse_since, parse_steps
    from rankwatch.sinks.store_table import alert_rows, eval_rows, format_rows, rollup_rows

    if cli_report.wants(args):  # --html / --compare: pictures, in cli_report
        return cli_report.run(args, _open_for_reading(_settings(args)))
    if not args.run:
        raise RankwatchError("report needs --run R (or --compare R1 R2 …)")
    try:
        f = Filters(metric=args.metric, rank=_rank(args.rank), steps=parse_steps(args.steps) if args.steps else
                    (None, None), since=parse_since(args.since) if args.since else None, limit=args.limit)
    except ValueError as exc:
        raise RankwatchError(str(exc)) from None
    q = _open_for_reading(_settings(args))
    kinds = ("eval", "rollups", "alerts") if args.kind == "all" else (args.kind,)
    reports = q.eval_reports(args.run, f) if "eval" in kinds else []
    rollups = q.rollups(args.run, f) if "rollups" in kinds else []
    alerts = q.alerts(args.run, f) if "alerts" in kinds else []
    if args.json:
        out = {"run": args.run}
        if "eval" in kinds:
            out["eval_reports"] = [as_json(r) for r in reports]
        if "rollups" in kinds:
            out["rollups"] = rollups
        if "alerts" in kinds:
            out["alerts"] = alerts
        print(json.dumps(encode_tree(out), indent=2))
        return 0
    if args.csv:
        kind = "rollups" if args.kind == "all" else args.kind
        header, rows = {"eval": eval_rows(reports), "rollups": rollup_rows(rollups), "alerts": alert_rows(alerts)}[kind]
        writer = csv.writer(sys.stdout)
        writer.writerow(header)
        writer.writerows(rows)
        return 0
    if not (reports or rollups or alerts):
        print(f"nothing stored for run {args.run!r} that matches", file=sys.stderr)
        return 0
    sections = []
    if reports:
        sections.append("eval reports\n" + format_table(reports))
    if rollups:
        sections.append("rollups\n" + format_rows(*rollup_rows(rollups)))
    if alerts:
        sections.append("alerts\n" + format_rows(*alert_rows(alerts)))
    print("\n\n".join(sections))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from rankwatch.sinks.store_table import format_rows, run_rows

    runs = _open_for_reading(_settings(args)).runs()
    if args.json:
        print(json.dumps(encode_tree(runs), indent=2))
    elif runs:
        print(format_rows(*run_rows(runs)))
    else:
        print("no runs stored yet", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from rankwatch.sinks.api import ReportAPI, make_server
    from rankwatch.sinks.store import store_url

    settings = _settings(args)
    _open_for_reading(settings)  # the same clear error as `report` when there is no store yet
    token = os.environ.get("RANKWATCH_API_TOKEN") or None  # kept out of argv and the settings' environment
    api = ReportAPI(store_url(settings), metrics_max_ranks=args.metrics_max_ranks, rules=settings.rules)
    server = make_server(api, args.host, args.port, token=token)
    host, port = server.server_address[:2]
    print(f"rankwatch serve: http://{host}:{port}/ (openapi.json, runs, metrics){'; bearer token required' if token else ''}",
          flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _rank(text: str | None) -> int | str | None:
    if text is None or text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise RankwatchError(f"--rank must be a rank number or 'all', got {text!r}") from None


def add_commands(add, bootstrap) -> None:
    """Register the subcommands with ``cli.build_parser``'s ``add`` and ``bootstrap`` helpers."""
    def store_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", metavar="URL", help="report store (default: $RANKWATCH_STORE_URL, else "
                       "SQLite at $RANKWATCH_DATA_DIR/store.db); postgresql://… for PostgreSQL")

    p = add("store", cmd_store, "Copy rankwatch.reports and rankwatch.alerts into the report store (`up` runs it too).")
    bootstrap(p)
    store_option(p)
    p.add_argument("--once", action="store_true", help="store what is on the topics, then exit")
    actions = p.add_subparsers(dest="store_action", metavar="ACTION", help="prune: delete old runs (without an "
                               "action, store copies the topics into the report store)")
    q = actions.add_parser("prune", help="delete the runs last active more than DAYS ago",
                           description="Delete the rollups, eval reports and alerts of every run whose newest row is "
                           "older than DAYS days, in one transaction (SQLite's file keeps its size and reuses the "
                           "space; VACUUM it while nothing writes to shrink it).")
    q.set_defaults(func=cmd_prune)
    q.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                   help="prune runs whose last activity is more than DAYS days old (fractions allowed)")
    q.add_argument("--dry-run", action="store_true", help="list the runs and count their rows; delete nothing")
    q.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,  # SUPPRESS: `store --store U prune` keeps U
                   help="report store (default: as for store)")
    p.add_argument("--from-beginning", action="store_true",
                   help="read every partition from its start, not from the position the store saved: for a broker "
                        "that started empty (`up` gives it for the embedded broker); stored rows are not duplicated")

    p = add("report", cmd_report, "A run's eval reports, rollups and alerts, from the report store.")
    store_option(p)
    p.add_argument("--run", help="run id (required, except beside --compare)")
    p.add_argument("--kind", choices=["all", "eval", "rollups", "alerts"], default="all",
                   help="what to show (default all; --csv shows one kind, the rollups unless given)")
    p.add_argument("--metric", help="only this metric")
    p.add_argument("--rank", help="only this rank; 'all' for the rollups merged across ranks")
    p.add_argument("--steps", metavar="A:B", help="only steps A to B (inclusive; A: or :B leave a side open)")
    p.add_argument("--since", metavar="WHEN", help="only rows written since WHEN: Unix seconds, ISO date-time, "
                   "or an age like 30m, 2h, 1d")
    p.add_argument("--limit", type=int, help="at most this many rollups and alerts")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object: eval_reports, rollups, alerts")
    out.add_argument("--csv", action="store_true", help="CSV of one kind (see --kind)")
    cli_report.add_options(p)

    p = add("serve", cmd_serve, "Serve the report store read-only over HTTP (JSON, /openapi.json, /metrics).")
    store_option(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs $RANKWATCH_API_TOKEN)")
    p.add_argument("--port", type=int, default=8321, help="port (default 8321; 0 picks a free one)")
    p.add_argument("--metrics-max-ranks", type=int, default=64,
                   help="/metrics exports ranks below this one, and every run-wide row (default 64)")

    p = add("runs", cmd_runs, "The runs in the report store: steps, world size, alerts.")
    store_option(p)
    p.add_argument("--json", action="store_true", help="a JSON array")
