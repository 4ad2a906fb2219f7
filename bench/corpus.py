"""Issue 18's bench: the default detector and rules on a varied corpus, tuning part beside held-out part.

1. NAB standard score (``nab_score``'s scorer) of the default series detector (``ensemble``) and
   of its members, on the generated and real streams of ``bench/data/corpus`` (made by
   ``bench/data/make_corpus.py``): NAB, recall, false positives per 10,000 scored rows of clean
   series, and the mean delay in rows, for the tuning part, the validation part (where a change
   that helps the tuning part is checked before it is kept) and the held-out part side by side.
2. False alerts per 10,000 clean rank-steps of the default rules on real clean training runs
   (``bench/corpus_runs.py``: a CPU torch loop through the real ``TrainerHook`` with eval pauses,
   checkpoints, epochs, warm-up, step decay, accumulation, a memory sawtooth, loader hiccups),
   replayed through both stages as the worker runs them (``scenario_replay``). Every alert there
   is false.
3. The same goal on the corpus of 1: false alerts per 10,000 clean rows of the default rules (both
   stages, as the worker runs them), each series read in turn as a loss, a grad norm and a
   throughput, the metrics with the most sensitive rules; and how many labelled windows they find.

The fault scenarios' recall and delays are ``bench/scenarios.py`` (run it with ``--first-seed``
on seeds not used for tuning).

    python bench/corpus.py            # records the clean runs on first use (~2 min), then ~6 min
    python bench/corpus.py --only sweep   # the robustness sweep (fresh seeds, wide ranges), ~1 min
    python bench/corpus.py --only rules   # the default rules on the corpus, ~5 min
    python bench/corpus.py --only sweep-rules   # the default rules on the sweep's series, ~3 min
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from corpus_runs import HOLDOUT_SEED, RUNS, record  # noqa: E402
from nab_score import Series, Tally, _candidates, _raw, sweep  # noqa: E402
from scenario_replay import replay  # noqa: E402
from scenario_runs import read_batches  # noqa: E402

from rankwatch.stream_processors.detectors import build  # noqa: E402
from rankwatch.stream_processors.rules import default_rules  # noqa: E402

CORPUS = HERE / "data" / "corpus"
RECORDINGS = HERE / "data" / "corpus_runs"
DETECTORS = ("ensemble", "spike", "cusum", "ewma")
#: Seeds of the robustness sweep (``--only sweep``): none of the parts' seeds.
SWEEP_SEEDS = range(400, 424)


def load(split: str) -> list[Series]:
    out = []
    for path in sorted((CORPUS / split).glob("*.csv")):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        out.append(Series(split, path.stem, np.array([float(r["value"]) for r in rows]),
                          np.array([int(r["label"]) for r in rows])))
    return out


def nab_table(splits: dict[str, list[Series]], names=DETECTORS) -> dict:
    head = f"{'NAB':>6s} {'recall':>6s} {'FP/10k':>7s} {'delay':>6s}"
    titles = {"tune": "tune", "validate": "validate", "holdout": "held-out"}
    print(f"{'detector':10s} | " + " | ".join(f"{titles[s]:^28s}" for s in splits)
          + " | held-out NAB at the tune-optimal threshold")
    print(f"{'':10s} | " + " | ".join(head for _ in splits) + " |")
    results = {}
    for name in names:
        cells = []
        scored = {}
        for split, items in splits.items():
            tally, clean = Tally(), Tally()
            scored[split] = []
            for s in items:
                d = build(name)
                scores = d.update(s.values)
                scored[split].append((s, scores, d.threshold))
                flags = d.decide(scores)
                sw = sweep(s.labels)
                tally.add(sw, flags)
                if not sw.n_windows:
                    clean.add(sw, flags)
            recall = tally.detected / tally.windows if tally.windows else float("nan")
            fp = 1e4 * clean.fp_rows / max(clean.rows, 1)
            delay = float(np.mean(tally.delays)) if tally.delays else float("nan")
            results[(name, split)] = {"nab": tally.nab(), "recall": recall, "fp_per_10k": fp, "delay": delay}
            cells.append(f"{tally.nab():6.1f} {recall:6.2f} {fp:7.1f} {delay:6.1f}")
        # NAB's optimiser: the threshold that maximises the tuning part's score, applied to the held-out part.
        best = max(_candidates(scored["tune"]), key=lambda t: _raw(scored["tune"], t))
        tuned = _raw(scored["holdout"], best)
        results[(name, "holdout@tuned")] = {"nab": tuned, "threshold": float(best)}
        print(f"{name:10s} | " + " | ".join(cells) + f" | {tuned:6.1f} (1 - {1 - best:.1g})", flush=True)
    return results


def _wide(rng: np.random.Generator, _part) -> dict:
    """Periods and noise over the whole range a training run might show, not one part's."""
    return {"eval": int(rng.integers(20, 250)), "ckpt": int(rng.integers(100, 1200)), "hiccup": int(rng.integers(10, 100)),
            "noise": float(rng.uniform(0.02, 0.15)), "decay": int(rng.integers(400, 1800)),
            "day": int(rng.choice([96, 144, 200, 288]))}


def _swept(seeds: range):
    """The sweep's series: the generator's shapes on ``seeds``, periods and noise drawn from ``_wide``."""
    sys.path.insert(0, str(HERE / "data"))
    import make_corpus

    make_corpus._params = _wide
    for seed in seeds:
        for name, x, labels in make_corpus.generated(seed, False):
            yield Series("sweep", name, x, labels)


def sweep_table(seeds: range = SWEEP_SEEDS, name: str = "ensemble") -> dict[str, Tally]:
    """A robustness check beside the parts: the generator's shapes on fresh seeds, each drawing its
    periods and noise from ``_wide``, scored per shape. Nothing is chosen on it alone; it shows
    whether a change that helps the tuning part holds for periods that part does not have."""
    per: dict[str, Tally] = {}
    for s in _swept(seeds):
        d = build(name)
        per.setdefault(s.name.split("_s")[0], Tally()).add(sweep(s.labels), d.decide(d.update(s.values)))
    total = Tally()
    for shape, t in per.items():
        print(f"{shape:10s} NAB {t.nab():6.1f}  recall {t.detected}/{t.windows}  false-positive rows {t.fp_rows}")
        total.raw, total.windows = total.raw + t.raw, total.windows + t.windows
        total.detected, total.fp_rows = total.detected + t.detected, total.fp_rows + t.fp_rows
    print(f"{'all':10s} NAB {total.nab():6.1f}  recall {total.detected}/{total.windows}  false-positive rows {total.fp_rows}")
    return per


#: Metrics whose default rules are the most sensitive: ``--only rules`` reads each corpus series as each.
RULED_AS = ("loss", "grad_norm", "samples_per_s")


def rules_table(splits: dict[str, list[Series]], rules=None) -> dict:
    """The default rules, not the bare detectors, on the corpus: each series replayed through both
    stages as one rank's metric named in ``RULED_AS``, a step a second. A firing alert on a row
    outside every labelled window and past NAB's probation is false; one inside a window finds it."""
    rules = rules or default_rules()
    print(f"{'read as':14s} | " + " | ".join(f"{s:^36s}" for s in splits))
    head = f"{'false':>6s} {'clean rows':>10s} {'per 10k':>8s} {'found':>8s}"
    print(f"{'':14s} | " + " | ".join(head for _ in splits))
    results = {}
    for metric in RULED_AS:
        cells, shapes = [], {}
        for split, items in splits.items():
            total = [0, 0, 0, 0]
            for s in items:
                tally = _judged(s, metric, rules)
                total = [a + b for a, b in zip(total, tally)]
                if split == "holdout" and tally[0]:
                    shape = "real" if s.name.startswith("real") else s.name.split("_s")[0]
                    shapes[shape] = shapes.get(shape, 0) + tally[0]
            false, clean, found, windows = total
            results[(metric, split)] = {"false": false, "clean_rows": clean, "found": found, "windows": windows}
            cells.append(f"{false:6d} {clean:10d} {1e4 * false / max(clean, 1):8.1f} {found:>4d}/{windows:<3d}")
        print(f"{metric:14s} | " + " | ".join(cells), flush=True)
        print(f"{'':14s}   held-out false alerts by shape: "
              + (", ".join(f"{k} {v}" for k, v in sorted(shapes.items(), key=lambda kv: -kv[1])) or "none"))
    return results


def sweep_rules_table(seeds: range = SWEEP_SEEDS, metric: str = "loss", rules=None) -> dict[str, list[int]]:
    """The default rules on the sweep's series (``sweep_table``), each read as ``metric``, per shape:
    false alerts per 10,000 clean rows and the labelled windows found, as ``rules_table`` counts them."""
    rules = rules or default_rules()
    per: dict[str, list[int]] = {}
    for s in _swept(seeds):
        tally = per.setdefault(s.name.split("_s")[0], [0, 0, 0, 0])
        tally[:] = [a + b for a, b in zip(tally, _judged(s, metric, rules))]
    per["all"] = [sum(t[i] for t in per.values()) for i in range(4)]
    for shape, (false, clean, found, windows) in per.items():
        print(f"{shape:10s} false {false:4d} / {clean:7d} clean rows ({1e4 * false / max(clean, 1):4.1f} per 10k), "
              f"found {found}/{windows}", flush=True)
    return per


def _judged(s: Series, metric: str, rules) -> tuple[int, int, int, int]:
    """The rules on ``s`` read as ``metric``: false alerts (firing outside every labelled window and
    past NAB's probation), clean rows, labelled windows an alert starts in, and labelled windows."""
    sw = sweep(s.labels)
    fired = {a.step for a in _replayed(s, metric, rules) if a.status == "firing"}
    false = sum(1 for step in fired if sw.window[step] == -1)
    found = len({int(sw.window[step]) for step in fired if sw.window[step] >= 0})
    return false, int((sw.window == -1).sum()), found, sw.n_windows


def _replayed(s: Series, metric: str, rules) -> list:
    """Stage 2's alerts for series ``s`` as one rank's ``metric``, one point a message a second."""
    from rankwatch.contract import Series as Points
    from rankwatch.contract import TelemetryBatch

    run = f"corpus-{s.name}"
    batches = [TelemetryBatch(run=run, rank=0, world_size=1, producer="corpus", seq=i, ts=float(i),
                              series={metric: Points(np.array([i], dtype=np.int64), np.array([v]))},
                              final=i == len(s.values) - 1)
               for i, v in enumerate(s.values.tolist())]
    return [e.alert for e in replay(batches, rules, run)]


def clean_runs(rules=None) -> dict[str, dict]:
    """False alerts of the default rules on the recorded clean runs, per part."""
    rules = rules or default_rules()
    out = {"tune": {"alerts": [], "rank_steps": 0}, "holdout": {"alerts": [], "rank_steps": 0}}
    for run in RUNS:
        path = record(run, RECORDINGS)
        batches = [b for r in range(run.ranks) for b in read_batches(path / f"rank{r}.bin")]
        steps = {int(s) for b in batches for series in b.series.values() for s in series.steps}
        part = out["tune" if run.seed < HOLDOUT_SEED else "holdout"]
        part["rank_steps"] += run.ranks * len(steps)
        seen = set()
        for e in replay(batches, rules, run.name):
            a = e.alert
            if a.status == "firing" and (a.key, a.incident) not in seen:
                seen.add((a.key, a.incident))
                part["alerts"].append(f"{run.name}: {a.detector}/{a.metric} ranks {list(a.ranks)} step {a.step}")
    for split, part in out.items():
        rate = 1e4 * len(part["alerts"]) / max(part["rank_steps"], 1)
        print(f"{split:8s}: {len(part['alerts'])} false alerts in {part['rank_steps']} clean rank-steps "
              f"= {rate:.1f} per 10k (goal <= 1)")
        for line in part["alerts"]:
            print(f"    {line}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("nab", "rules", "runs", "sweep", "sweep-rules"), help="one table")
    parser.add_argument("--proposed", action="store_true",
                        help="also score the scenario bench's proposed rules (scenario_rules) on the clean runs")
    args = parser.parse_args(argv)
    if not (CORPUS / "validate").exists():
        made = subprocess.run([sys.executable, str(HERE / "data" / "make_corpus.py")])
        if made.returncode:
            return made.returncode  # make_corpus printed why
    if args.only in (None, "nab", "rules"):
        splits = {split: load(split) for split in ("tune", "validate", "holdout")}
    if args.only in (None, "nab"):
        for split, items in splits.items():
            windows = sum(sweep(s.labels).n_windows for s in items)
            print(f"{split}: {len(items)} series, {sum(len(s.values) for s in items)} rows, {windows} scored windows")
        print("\nNAB standard profile, default parameters and thresholds (FP/10k: on the clean series):")
        nab_table(splits)
    if args.only in (None, "rules"):
        print("\nDefault rules on the corpus, each series read as one rank's metric (false alerts on clean rows, "
              "labelled windows found):")
        rules_table(splits)
    if args.only == "sweep":
        print(f"Robustness sweep: {len(SWEEP_SEEDS)} fresh seeds of each shape, periods and noise drawn wide:")
        sweep_table(SWEEP_SEEDS)
    if args.only == "sweep-rules":
        print(f"The default rules on the sweep's series ({len(SWEEP_SEEDS)} seeds of each shape), read as a loss:")
        sweep_rules_table(SWEEP_SEEDS)
    if args.only in (None, "runs"):
        print("\nDefault rules on clean recorded training runs (every alert is false):")
        clean_runs()
        if args.proposed:
            from scenario_rules import proposed_rules

            print("\nThe scenario bench's proposed rules on the same runs:")
            clean_runs(proposed_rules())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
