"""A varied labelled corpus: training-telemetry shapes full of normal structure, and real streams.

Two sources, written as ``corpus/{tune,holdout}/{name}.csv`` (``timestamp,value,label``; label 1
marks NAB's anomaly window, which starts at the fault's onset):

- **Generated** series shaped like what a training run publishes, with the structure that is
  *not* a fault: warm-up, step learning-rate decays (a level change that is expected), evaluation
  pauses every N steps and checkpoint saves every M steps (step-time bursts), data-loader hiccups
  on a period, gradient-norm bursts, a memory sawtooth, a daily cycle, Poisson counts, a nearly
  flat gauge. About a third are clean; the others carry one or two faults (a spike, a blow-up by
  orders of magnitude, a level shift that persists, a straggler, a dip). Tuning and held-out
  series come from different seeds, and the held-out ones also from other periods and noise levels
  (``_params``). A third, validation part (generated only, other seeds and a third set of ranges)
  is where a change that helps the tuning part is checked before it is kept.
- **Real streams** that ship inside statsmodels (Mauna Loa CO2, sunspots, the Nile, El Niño, US
  macro series), unlabelled except the Nile's known change point (the Aswan dam, 1899): they count
  as clean series for false alerts. Alternate streams go to each part. They need statsmodels
  (``pip install -e '.[bench]'``).

    python bench/data/make_corpus.py       # a few seconds; rewrites corpus/
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "corpus"
N = 3000
TUNE_SEEDS, VALIDATE_SEEDS, HOLDOUT_SEEDS = range(0, 6), range(200, 206), range(100, 106)


def _params(rng: np.random.Generator, holdout: bool | str) -> dict:
    """Periods and noise: the held-out part draws from other ranges than the tuning part, and the
    validation part from a third set (longer evaluation and checkpoint periods than either, a
    shorter day), so a choice can be checked on shapes it was not made on without the held-out part."""
    if holdout == "validate":
        return {"eval": int(rng.integers(141, 220)), "ckpt": int(rng.integers(701, 1000)), "hiccup": int(rng.integers(61, 90)),
                "noise": float(rng.uniform(0.05, 0.15)), "decay": int(rng.integers(1300, 1800)), "day": 96}
    if holdout:
        return {"eval": int(rng.integers(61, 140)), "ckpt": int(rng.integers(301, 700)), "hiccup": int(rng.integers(13, 30)),
                "noise": float(rng.uniform(0.03, 0.12)), "decay": int(rng.integers(700, 1300)), "day": 144}
    return {"eval": int(rng.integers(25, 60)), "ckpt": int(rng.integers(150, 300)), "hiccup": int(rng.integers(31, 60)),
            "noise": float(rng.uniform(0.02, 0.08)), "decay": int(rng.integers(500, 900)), "day": 288}


def loss(rng, p):
    t = np.arange(N)
    warm = np.minimum(1.0, (t + 1) / 50)
    level = 0.4 + 2.0 * np.exp(-t / 600) * (1.5 - 0.5 * warm)
    level = level * 0.85 ** (t // p["decay"])  # a step decay lowers the loss at once: expected
    return level * np.exp(rng.normal(0, p["noise"], N))


def step_time(rng, p):
    t = np.arange(N)
    x = 0.1 * np.exp(rng.normal(0, p["noise"], N))
    x[t % p["eval"] == 0] *= 6.0  # evaluation pause
    x[t % p["ckpt"] == 0] *= 12.0  # checkpoint save
    x[t % p["hiccup"] == p["hiccup"] - 1] += 0.02  # the loader's periodic hiccup
    return x


def grad_norm(rng, p):
    t = np.arange(N)
    level = 1.0 + 4.0 * np.exp(-t / 300)
    bursts = np.where(rng.random(N) < 0.03, rng.uniform(1.5, 3.0, N), 1.0)  # routine gradient bursts
    return level * bursts * np.exp(rng.normal(0, 2 * p["noise"], N))


def memory(rng, p):
    t = np.arange(N)
    return 2000.0 + 3.0 * (t % p["ckpt"]) + rng.normal(0, 2.0, N)  # caches grow until a checkpoint frees them


def daily(rng, p):
    t = np.arange(N)
    return 50 + 20 * np.sin(2 * np.pi * t / p["day"]) + 5 * np.sin(4 * np.pi * t / p["day"]) + rng.normal(0, 20 * p["noise"], N)


def counts(rng, p):
    return rng.poisson(20 + 10 * np.sin(2 * np.pi * np.arange(N) / p["day"]), N).astype(float)


def gauge(rng, p):
    return np.round(75.0 + np.cumsum(rng.normal(0, 0.02, N)) * 0.1, 1)  # a quantised, nearly flat reading


SHAPES = {"loss": loss, "step_time": step_time, "grad_norm": grad_norm, "memory": memory,
          "daily": daily, "counts": counts, "gauge": gauge}

#: Faults that make sense for each shape (a name maps to an injector below).
FAULTS = {
    "loss": ["spike", "blowup", "shift_up"], "step_time": ["straggler", "stall_spike"],
    "grad_norm": ["blowup", "spike"], "memory": ["shift_up"], "daily": ["spike", "dip", "shift_up"],
    "counts": ["burst"], "gauge": ["shift_up", "spike"],
}


def inject(x: np.ndarray, fault: str, at: int, rng) -> int:
    """Apply ``fault`` from row ``at``; return how many rows the fault itself lasts (0: to the end)."""
    steps = np.abs(np.diff(x))
    scale = np.median(steps) / 0.954 + 1e-9 * abs(np.median(x))  # noise sigma, from differences
    # A quantised reading that mostly holds still has a median step of 0: its faults were sized
    # 1e-6 (invisible, yet labelled). Size them in its resolution instead, and keep it quantised.
    quantum = float(steps[steps > 0].min()) if np.median(steps) == 0 and (steps > 0).any() else 0.0
    if quantum:
        return _inject(x, fault, at, rng, quantum, lambda v: np.round(v / quantum) * quantum)
    return _inject(x, fault, at, rng, scale, lambda v: v)


def _inject(x: np.ndarray, fault: str, at: int, rng, scale: float, snap) -> int:
    if fault == "spike":
        x[at] += snap(rng.choice([-1, 1]) * rng.uniform(12, 30) * scale if x.min() < 0 else rng.uniform(12, 30) * scale)
        return 1
    if fault == "stall_spike":
        x[at] *= 60.0
        return 1
    if fault == "blowup":
        x[at:] *= 10 ** rng.uniform(2, 4)
        return 0
    if fault == "shift_up":
        x[at:] += snap(rng.uniform(6, 12) * scale)
        return 0
    if fault == "straggler":
        x[at : at + 150] *= 1.4
        return 150
    if fault == "dip":
        x[at : at + 20] -= snap(rng.uniform(8, 15) * scale)
        return 20
    if fault == "burst":
        x[at : at + 10] += rng.uniform(25, 40)
        return 10
    raise ValueError(fault)


def generated(seed: int, holdout: bool | str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    out = []
    for shape, make in SHAPES.items():
        rng = np.random.default_rng([seed, len(shape)])
        p = _params(rng, holdout)
        x = make(rng, p)
        labels = np.zeros(N, dtype=int)
        n_faults = int(rng.choice([0, 1, 1, 2]))
        onsets = sorted(rng.choice(np.arange(int(0.3 * N), int(0.9 * N), 200), n_faults, replace=False).tolist())
        width = int(0.1 * N / max(n_faults, 1))
        names = []
        for at in onsets:
            fault = str(rng.choice(FAULTS[shape]))
            if fault in ("blowup", "shift_up") and at != onsets[-1]:
                fault = "spike"  # a lasting fault only last, so the next window is not inside it
            inject(x, fault, at, rng)
            labels[at : at + width] = 1
            names.append(fault)
        out.append((f"{shape}_s{seed}_{'-'.join(names) or 'clean'}", x, labels))
    return out


def real_streams() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Real-world streams shipped inside statsmodels."""
    try:
        from statsmodels import datasets
    except ImportError:  # without them every score would silently be of another corpus
        raise SystemExit("make_corpus: the real-world streams need statsmodels: pip install -e '.[bench]'") from None
    out = []
    co2 = datasets.co2.load_pandas().data["co2"].interpolate().bfill().to_numpy()
    out.append(("real_co2", co2))
    out.append(("real_sunspots", datasets.sunspots.load_pandas().data["SUNACTIVITY"].to_numpy()))
    out.append(("real_elnino", datasets.elnino.load_pandas().data.iloc[:, 1:13].to_numpy().ravel()))
    macro = datasets.macrodata.load_pandas().data
    for col in ("realgdp", "infl", "unemp", "realint", "cpi", "m1"):
        out.append((f"real_macro_{col}", macro[col].to_numpy()))
    nile = datasets.nile.load_pandas().data["volume"].to_numpy()
    labels = np.zeros(len(nile), dtype=int)
    labels[28:38] = 1  # the Aswan dam, 1899 (a known level change)
    result = [(n, np.asarray(v, dtype=float), np.zeros(len(v), dtype=int)) for n, v in out]
    result.append(("real_nile", nile.astype(float), labels))
    return result


def write(split: str, name: str, x: np.ndarray, labels: np.ndarray) -> None:
    path = OUT / split / f"{name}.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "value", "label"])
        w.writerows((i, repr(float(v)), int(lab)) for i, (v, lab) in enumerate(zip(x, labels)))


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    for split in ("tune", "validate", "holdout"):
        (OUT / split).mkdir(parents=True)
    (OUT / ".gitignore").write_text("# generated by bench/data/make_corpus.py in seconds\n*\n")
    for split, seeds in (("tune", TUNE_SEEDS), ("validate", VALIDATE_SEEDS), ("holdout", HOLDOUT_SEEDS)):
        for seed in seeds:
            for name, x, labels in generated(seed, {"tune": False, "validate": "validate", "holdout": True}[split]):
                write(split, name, x, labels)
    for i, (name, x, labels) in enumerate(real_streams()):
        write("tune" if i % 2 == 0 else "holdout", name, x, labels)
    for split in ("tune", "validate", "holdout"):
        print(f"{split}: {len(list((OUT / split).glob('*.csv')))} series")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
