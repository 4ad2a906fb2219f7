"""``rankwatch score-series``: a real subprocess round trip, and the parsing it relies on."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import numpy as np
import pytest

from rankwatch.score_series import SERIES_DETECTORS, ScoreSeriesError, parse_param, run
from rankwatch.stream_processors.detectors import BY_NAME

RANKWATCH = [sys.executable, "-m", "rankwatch", "score-series"]


def _series(n: int = 200, spike_at: int = 150) -> list[tuple[str, float]]:
    values = np.random.default_rng(0).normal(1.0, 0.01, n)
    values[spike_at] = 3.0
    return [(f"2024-01-01T00:{i // 60:02d}:{i % 60:02d}", float(v)) for i, v in enumerate(values)]


def _write(path, rows, header=("timestamp", "value")) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        out.writerows(rows)


def _read(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_round_trip_through_the_cli_keeps_every_row_and_column(tmp_path):
    rows = [(ts, v, "1" if i == 150 else "0") for i, (ts, v) in enumerate(_series())]
    _write(tmp_path / "in.csv", rows, header=("timestamp", "value", "label"))
    done = subprocess.run([*RANKWATCH, str(tmp_path / "in.csv"), "--detector", "spike", "-o", str(tmp_path / "out.csv")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "scored 200 rows with spike" in done.stderr
    out = _read((tmp_path / "out.csv").read_text())
    assert list(out[0]) == ["timestamp", "value", "label", "anomaly_score"]
    assert [(r["timestamp"], r["value"], r["label"]) for r in out] == [(ts, repr(v), lab) for ts, v, lab in rows]
    scores = np.array([float(r["anomaly_score"]) for r in out])
    assert int(np.argmax(scores)) == 150 and scores[150] >= 0.99
    assert np.all((scores >= 0) & (scores <= 1)) and scores[:20].max() == 0.0  # warm-up


def test_stdin_to_stdout_with_params_and_decisions(tmp_path):
    text = "timestamp,value\n" + "".join(f"{ts},{v}\n" for ts, v in _series())
    done = subprocess.run([*RANKWATCH, "-", "--detector", "spike", "--param", "direction=down", "--decisions"],
                          input=text, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = _read(done.stdout)
    assert len(out) == 200 and out[150]["anomaly"] == "0"  # an upward spike, but only "down" is watched
    done = subprocess.run([*RANKWATCH, "-", "--decisions"], input=text, capture_output=True, text=True, timeout=120)
    assert [i for i, r in enumerate(_read(done.stdout)) if r["anomaly"] == "1"] == [150]  # the default ensemble


@pytest.mark.parametrize(
    "args, message",
    [
        (["--param", "h=high", "--detector", "cusum"], "h must be a number"),
        (["--param", "nope=1", "--detector", "cusum"], "has no parameter 'nope'"),
        (["--param", "novalue", "--detector", "cusum"], "KEY=VALUE"),
        (["--detector", "crossrank"], "invalid choice"),
    ],
)
def test_clear_errors_for_bad_parameters(tmp_path, args, message):
    _write(tmp_path / "in.csv", _series(20, spike_at=10))
    done = subprocess.run([*RANKWATCH, str(tmp_path / "in.csv"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_bad_input_files_are_reported_with_their_line(tmp_path):
    _write(tmp_path / "cols.csv", [("1", "2")], header=("time", "value"))
    with pytest.raises(ScoreSeriesError, match="missing timestamp"):
        run(str(tmp_path / "cols.csv"), str(tmp_path / "o.csv"), "spike", {})
    _write(tmp_path / "text.csv", [("1", "2.0"), ("2", "oops")])
    with pytest.raises(ScoreSeriesError, match="line 3: value 'oops'"):
        run(str(tmp_path / "text.csv"), str(tmp_path / "o.csv"), "spike", {})
    with pytest.raises(ScoreSeriesError, match="cannot open"):
        run(str(tmp_path / "absent.csv"), str(tmp_path / "o.csv"), "spike", {})


def test_empty_values_are_missing_points_and_nonfinite_scores_them(tmp_path):
    _write(tmp_path / "in.csv", [("1", "1.0"), ("2", ""), ("3", "nan"), ("4", "inf")])
    assert run(str(tmp_path / "in.csv"), str(tmp_path / "out.csv"), "nonfinite", {}) == 4
    out = _read((tmp_path / "out.csv").read_text())
    assert [r["anomaly_score"] for r in out] == ["0.0", "1.0", "1.0", "1.0"]
    assert [r["value"] for r in out] == ["1.0", "", "nan", "inf"]  # written back as read


def test_stall_scores_the_gaps_between_timestamps(tmp_path):
    stamps = [float(i) for i in range(30)] + [60.0, 61.0, 62.0]  # a 31 s silence before row 30
    _write(tmp_path / "in.csv", [(f"{t:.1f}", "0") for t in stamps])
    run(str(tmp_path / "in.csv"), str(tmp_path / "out.csv"), "stall", {"min_bound_s": 0.0}, decisions=True)
    out = _read((tmp_path / "out.csv").read_text())
    assert [i for i, r in enumerate(out) if r["anomaly"] == "1"] == [30]


def test_parse_param_reads_json_and_falls_back_to_text():
    assert parse_param("h=12") == ("h", 12)
    assert parse_param("long_run=false") == ("long_run", False)
    assert parse_param("direction=up") == ("direction", "up")
    assert parse_param(" bound_s = null") == ("bound_s", None)
    assert parse_param('members=["spike"]') == ("members", ["spike"])


def test_the_cli_offers_every_series_detector():
    assert set(SERIES_DETECTORS) == set(BY_NAME) - {"crossrank"}
