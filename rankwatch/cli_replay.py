"""``rankwatch record`` and ``rankwatch replay`` (rankwatch/replay.py): back-test rules on past runs."""

from __future__ import annotations

import argparse
import sys

from rankwatch.settings import Settings


def cmd_record(args: argparse.Namespace) -> int:
    from rankwatch.replay import record

    settings = Settings.from_env(bootstrap=args.bootstrap)
    counts = record(settings.bootstrap, args.run, args.file, security=settings.security)
    print(f"recorded run {args.run}: {counts.get('telemetry', 0)} telemetry messages, "
          f"{counts.get('eval_shard', 0)} eval shards -> {args.file}", file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from rankwatch.replay import replay

    settings = Settings.from_env(bootstrap=args.bootstrap)
    run, sent = replay(settings.bootstrap, args.file, run=args.run, security=settings.security)
    print(f"replayed {sent} messages as run {run}; once the workers are through: "
          f"rankwatch report --run {run} --kind alerts", file=sys.stderr)
    print(run)
    return 0


def add_commands(add, bootstrap) -> None:
    p = add("record", cmd_record, "Save a run's telemetry and eval shards from the topics to a file (for replay).")
    bootstrap(p)
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("file", help="the recording to write (JSON lines)")

    p = add("replay", cmd_replay, "Send a recorded run through the running workers again, as a new run "
            "(back-test rules: start the workers with the new RANKWATCH_RULES first).")
    bootstrap(p)
    p.add_argument("file", help="a recording from `rankwatch record`")
    p.add_argument("--run", help="the new run id (default: <recorded run>-replay-<HHMMSS>); printed on stdout")
