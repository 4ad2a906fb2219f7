"""The subcommands that read rankwatch's topics: ``alerts``, ``notify``, ``tail``, ``deadletters``.
``cli.build_parser`` calls ``add_commands``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rankwatch import contract
from rankwatch.cli_common import settings_of as _settings
from rankwatch.cli_common import until_ctrl_c
from rankwatch.errors import RankwatchError


def emit_alert(value: bytes, sink, run: str | None = None) -> None:
    try:
        alert = contract.Alert.from_bytes(value)
    except contract.SchemaError as exc:
        print(f"(undecodable alert skipped: {exc})", file=sys.stderr)
        return
    if run is None or alert.run == run:
        sink.add(alert)
        sink.flush()


def cmd_alerts(args: argparse.Namespace) -> int:
    from rankwatch.sinks import TerminalSink, read_topic

    sink = TerminalSink(as_json=args.json)
    with until_ctrl_c() as pressed:
        settings = _settings(args)
        for record in read_topic(settings.bootstrap, contract.ALERTS, follow=args.follow, stop=pressed,
                                 security=settings.security):
            emit_alert(record.value, sink, args.run)
    return 0


def cmd_notify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rankwatch.sinks import JsonlSink, Notifier, TerminalSink, WebhookSink
    from rankwatch.sinks.alertmanager import AlertmanagerSink
    from rankwatch.sinks.webhook import ALERTMANAGER_API, Secret

    settings = _settings(args)
    sinks = [] if args.quiet else [TerminalSink()]
    if args.jsonl:
        sinks.append(JsonlSink(args.jsonl))
    if args.webhook:
        url = os.environ.get("RANKWATCH_WEBHOOK_URL")
        if not url:
            raise RankwatchError("--webhook needs the URL in $RANKWATCH_WEBHOOK_URL (kept out of argv and logs)")
        token = Secret(os.environ["RANKWATCH_WEBHOOK_TOKEN"]) if os.environ.get("RANKWATCH_WEBHOOK_TOKEN") else None
        if args.format in ALERTMANAGER_API:
            sinks.append(AlertmanagerSink(Secret(url), token=token, resend_s=args.resend))
        else:
            sinks.append(WebhookSink(Secret(url), format=args.format, token=token))
    if not sinks:
        raise RankwatchError("nothing to deliver to: give --jsonl and/or --webhook, or drop --quiet")
    state = Path(args.state) if args.state else Path(settings.data_dir) / "notify-offsets.json"
    notifier = Notifier(sinks, run=args.run, state_path=state)
    with until_ctrl_c() as pressed:  # an alert being delivered is finished and its offset saved
        notifier.follow(settings.bootstrap, follow=not args.once, from_beginning=args.from_beginning, stop=pressed,
                        security=settings.security)
    print(f"delivered {notifier.delivered}, undelivered {notifier.failed}", file=sys.stderr)
    if notifier.undelivered:  # the run stopped before it: say which and why, and what happens next
        print(f"undelivered: {notifier.undelivered}; the next run starts with it", file=sys.stderr)
    return 0 if not notifier.failed else 1


def cmd_tail(args: argparse.Namespace) -> int:
    from rankwatch.sinks import read_topic

    settings = _settings(args)
    with until_ctrl_c() as pressed:
        for record in read_topic(
            settings.bootstrap, args.topic, follow=args.follow, from_beginning=not args.from_end, stop=pressed,
            security=settings.security,
        ):
            try:
                line = json.dumps(contract.decode_any(record.value))
            except contract.SchemaError:
                line = json.dumps({"undecodable": record.value.decode("utf-8", "replace")})
            print(line, flush=True)
    return 0


def cmd_deadletters(args: argparse.Namespace) -> int:
    from collections import Counter

    from rankwatch.sinks import read_topic

    counts: Counter[tuple[str, str]] = Counter()
    latest: dict[tuple[str, str], str] = {}
    settings = _settings(args)
    for record in read_topic(settings.bootstrap, contract.DEADLETTER, security=settings.security):
        try:
            letter = contract.DeadLetter.from_bytes(record.value)
            where, reason = (letter.topic, letter.cause), letter.reason
        except contract.SchemaError:  # not written by a rankwatch worker; still counted
            where, reason = ("?", "not a dead letter"), ""
        counts[where] += 1
        latest[where] = reason
    rows = [{"topic": t, "cause": c, "count": n, "latest": latest[t, c]} for (t, c), n in counts.most_common()]
    if args.json:
        print(json.dumps({"total": sum(counts.values()), "by_cause": rows}))
        return 0
    for row in rows:
        reason = row["latest"] if len(row["latest"]) <= 100 else row["latest"][:99] + "…"
        print(f"{row['count']:>10,}  {row['topic']:<24} {row['cause']:<24} latest: {reason}")
    print(f"{sum(counts.values()):>10,}  dead letters in {contract.DEADLETTER}")
    return 0


def add_commands(add, bootstrap) -> None:
    """Register the subcommands with ``cli.build_parser``'s ``add`` and ``bootstrap`` helpers."""
    p = add("alerts", cmd_alerts, f"Print alerts from {contract.ALERTS}.")
    bootstrap(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new alerts until Ctrl-C")
    p.add_argument("--run", help="only alerts of this run")
    p.add_argument("--json", action="store_true", help="one JSON object per line, as on the wire")

    p = add("notify", cmd_notify, "Deliver alerts to a JSONL file and/or a webhook (Slack, Alertmanager, JSON).")
    bootstrap(p)
    p.add_argument("--jsonl", metavar="PATH", help="append each alert as a JSON line to PATH")
    p.add_argument("--webhook", action="store_true",
                   help="POST alerts to $RANKWATCH_WEBHOOK_URL (bearer token from $RANKWATCH_WEBHOOK_TOKEN if set)")
    p.add_argument("--format", choices=["json", "slack", "alertmanager", "alertmanager-api", "alertmanager-webhook"],
                   default="json", help="webhook body: rankwatch JSON, Slack incoming-webhook, Alertmanager's API "
                   "(alertmanager = alertmanager-api: the URL is Alertmanager's, firing alerts are re-sent), or "
                   "the payload Alertmanager sends its webhook receivers (alertmanager-webhook)")
    p.add_argument("--resend", type=float, default=60.0, metavar="SECONDS",
                   help="Alertmanager: re-send firing alerts this often, each held for 4x as long (default 60)")
    p.add_argument("--run", help="only alerts of this run")
    p.add_argument("--from-beginning", action="store_true",
                   help="start at the oldest alert the first time (later runs resume where they stopped)")
    p.add_argument("--once", action="store_true", help="deliver what is there, then exit")
    p.add_argument("--state", metavar="PATH", help="where to remember the read position "
                   "(default: $RANKWATCH_DATA_DIR/notify-offsets.json)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not also print alerts to the terminal")

    p = add("tail", cmd_tail, "Print any rankwatch topic as JSON lines (the embedded broker does not speak to kcat).")
    bootstrap(p)
    p.add_argument("topic", choices=contract.TOPICS, metavar="TOPIC", help=f"one of: {', '.join(contract.TOPICS)}")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new messages until Ctrl-C")
    p.add_argument("--from-end", action="store_true", help="only messages that arrive from now on")

    p = add("deadletters", cmd_deadletters,
            f"Count the messages workers dead-lettered to {contract.DEADLETTER}, by topic and cause "
            f"(`rankwatch tail {contract.DEADLETTER}` prints them).")
    bootstrap(p)
    p.add_argument("--json", action="store_true", help="one JSON object: the total and the counts")
