"""``rankwatch score-series``: back-test one detector on a CSV series, offline.

Reads a CSV with a header naming at least ``timestamp`` and ``value``, runs the detector over the
values in order (``update``: each point scored against everything before it), and writes the same
rows and columns with an ``anomaly_score`` column (replaced if present). An empty value is a
missing point (NaN). The ``stall`` detector scores the gaps between timestamps (unix seconds or
ISO 8601) instead of the values: each row scores the silence that preceded it.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from rankwatch.errors import RankwatchError

#: Detectors that score a single series (``crossrank`` needs one value per rank per step). Spelled
#: out so that ``rankwatch --help`` need not import numpy and scipy; a test keeps it in step.
SERIES_DETECTORS = (
    "ensemble", "nonfinite", "spike", "ewma", "explode", "cusum", "page_hinkley", "trend", "plateau", "collapse", "blowup",
    "stall",
)
DEFAULT_DETECTOR = "ensemble"

SCORE_COLUMN = "anomaly_score"
DECISION_COLUMN = "anomaly"


class ScoreSeriesError(RankwatchError):
    """The input or the detector parameters cannot be used; the message says why."""


def parse_param(text: str) -> tuple[str, Any]:
    """``k=v`` with ``v`` read as JSON where it can be (``12``, ``0.5``, ``false``, ``null``), else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ScoreSeriesError(f"--param wants KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _number(text: str, line: int) -> float:
    if not text.strip():
        return float("nan")
    try:
        return float(text)
    except ValueError:
        raise ScoreSeriesError(f"line {line}: value {text!r} is not a number") from None


def _seconds(text: str, line: int) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ScoreSeriesError(f"line {line}: timestamp {text!r} is neither seconds nor ISO 8601") from None


@contextmanager
def _open(path: str, mode: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdin if "r" in mode else sys.stdout
        return
    try:
        f = open(path, mode, newline="", encoding="utf-8")
    except OSError as exc:
        raise ScoreSeriesError(f"cannot open {path}: {exc.strerror}") from None
    with f:
        yield f


def score_rows(rows: list[dict[str, str]], detector: str, params: dict[str, Any]) -> tuple[np.ndarray, float]:
    """The detector's scores (and its threshold) for CSV rows that have ``timestamp`` and ``value``."""
    import numpy as np

    from rankwatch.stream_processors.detectors import build

    if detector not in SERIES_DETECTORS:
        raise ScoreSeriesError(f"{detector!r} does not score one series; choose from {', '.join(SERIES_DETECTORS)}")
    try:
        d = build(detector, **params)
    except ValueError as exc:
        raise ScoreSeriesError(str(exc)) from None
    if detector == "stall":
        stamps = np.array([_seconds(r["timestamp"], i + 2) for i, r in enumerate(rows)])
        series = np.r_[np.nan, np.diff(stamps)] if len(stamps) else stamps
    else:
        series = np.array([_number(r["value"], i + 2) for i, r in enumerate(rows)])
    return d.update(series), d.threshold


def run(source: str, out: str, detector: str, params: dict[str, Any], decisions: bool = False) -> int:
    """Score ``source`` into ``out`` (``-`` for stdin/stdout); returns the number of rows."""
    with _open(source, "r") as f:
        reader = csv.DictReader(f)
        fields = list(reader.fieldnames or [])
        missing = [c for c in ("timestamp", "value") if c not in fields]
        if missing:
            raise ScoreSeriesError(f"{source}: the header needs columns timestamp and value (missing {', '.join(missing)})")
        rows = list(reader)
    scores, threshold = score_rows(rows, detector, params) if rows else ([], 0.5)
    added = [SCORE_COLUMN] + ([DECISION_COLUMN] if decisions else [])
    columns = [c for c in fields if c not in added] + added
    with _open(out, "w") as f:
        writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        for row, score in zip(rows, [float(s) for s in scores]):
            row[SCORE_COLUMN] = repr(score)
            if decisions:
                row[DECISION_COLUMN] = str(int(score >= threshold))
            writer.writerow(row)
    return len(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.csv", help="CSV with a header naming timestamp and value; - reads stdin")
    p.add_argument("--detector", default=DEFAULT_DETECTOR, choices=SERIES_DETECTORS, metavar="NAME",
                   help=f"one of: {', '.join(SERIES_DETECTORS)} (default {DEFAULT_DETECTOR}: "
                        "nonfinite + spike + cusum, for a series nothing is known about)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a detector parameter, repeatable; VALUE is read as JSON if it parses, else as text "
                        "(e.g. --param direction=up --param h=12 --param 'members=[\"spike\", [\"cusum\", {\"h\": 12}]]')")
    p.add_argument("-o", "--output", default="-", metavar="OUT.csv", help="where to write (default: stdout)")
    p.add_argument("--decisions", action="store_true",
                   help=f"also write an {DECISION_COLUMN} column: 1 where the score reaches the detector's threshold")


def cmd_score_series(args: argparse.Namespace) -> int:
    params = dict(parse_param(p) for p in args.param)
    n = run(args.file, args.output, args.detector, params, decisions=args.decisions)
    if args.output != "-":
        print(f"scored {n} rows with {args.detector} into {args.output}", file=sys.stderr)
    return 0
