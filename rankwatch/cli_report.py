"""``rankwatch report``'s pictures: ``--html PATH`` for one run, ``--compare R1 R2 …`` for several.

Kept beside ``cli_store.py`` (which owns ``report``'s table, JSON and CSV output) so that file stays about
querying; ``cli_store.cmd_report`` hands over here when either option is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rankwatch.errors import RankwatchError


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--html", metavar="PATH", help="write one self-contained HTML report (charts, no network)")
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="compare these runs: eval metrics on one axis, final and best scores with Welch tests, the "
                        "best on the composite score (text; with --html a page, with --json one object)")
    p.add_argument("--forecast", action="store_true",
                   help="each eval metric's (and each rule-watched metric's) trend: plateau or collapse expected "
                        "when (with --json: the fits and their 95%% prediction bands)")
    p.add_argument("--heatmap-metric", metavar="M", help="metric of the rank × step heatmap (default: step time)")


def wants(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "html", None) or getattr(args, "compare", None) or getattr(args, "forecast", False))


def run(args: argparse.Namespace, queries) -> int:
    from rankwatch.sinks.html_report import render_run

    if args.compare:
        return compare(args, queries)
    if not args.run:
        raise RankwatchError("--html and --forecast need --run R")
    if not queries.eval_reports(args.run) and not queries.rollups(args.run):
        raise RankwatchError(f"nothing stored for run {args.run!r}: see `rankwatch runs`")
    forecasts = _forecasts(args, queries)
    if args.html:
        text = render_run(queries, args.run, heatmap_metric=args.heatmap_metric, forecasts=forecasts)
        Path(args.html).write_text(text, encoding="utf-8")
        print(f"wrote {args.html} ({len(text) // 1024} KiB)", file=sys.stderr)
    if args.forecast:
        from rankwatch.sinks.html_report import clean
        from rankwatch.sinks.report_forecast import verdicts

        if args.json:
            import json

            print(json.dumps(clean({"run": args.run, **forecasts}), indent=2))
        else:
            print("\n".join(verdicts(forecasts)) or "nothing to forecast (too few points)")
    return 0


def _forecasts(args: argparse.Namespace, queries) -> dict:
    from rankwatch.cli_store import _settings
    from rankwatch.sinks.report_forecast import run_forecasts
    from rankwatch.stream_processors.rules import Rules

    return run_forecasts(queries, args.run, Rules.load(_settings(args).rules or None))


def compare(args: argparse.Namespace, queries) -> int:
    import json

    from rankwatch.sinks.compare import format_text, render_compare

    runs = list(dict.fromkeys(([args.run] if args.run else []) + args.compare))
    if len(runs) < 2:
        raise RankwatchError("--compare needs two runs or more")
    missing = [r for r in runs if not queries.eval_reports(r) and not queries.rollups(r)]
    if missing:
        raise RankwatchError(f"nothing stored for run(s) {', '.join(missing)}: see `rankwatch runs`")
    text, result = render_compare(queries, runs)
    if args.html:
        Path(args.html).write_text(text, encoding="utf-8")
        print(f"wrote {args.html} ({len(text) // 1024} KiB)", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    elif not args.html:
        print(format_text(result))
    return 0
