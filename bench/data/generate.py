"""Labelled metric series from real small training runs on CPU, with injected faults.

Every series is what a run actually logged: a minibatch loss, the pre-clip gradient norm and the
measured wall time of an MLP on scikit-learn's digits, and the mean reward, policy entropy and
KL per update of a REINFORCE policy on a contextual bandit. Faults are injected into the training
itself (a NaN batch, a corrupted batch, a learning rate x100, growing label noise, a learning rate
of 0, a sleeping rank, a shifted environment, a sign bug in the policy gradient), and the rows
from the fault's onset are labelled 1: NAB's anomaly window, 120 rows (10% of the series) after a
transient fault, the fault's duration for a straggler, the rest of the run when the fault lasts
(growing label noise, a learning rate of 0).

Seeds 0 and 1 go to ``tune/`` (used to choose defaults), seeds 2 and 3 to ``holdout/`` (only
reported). Files: ``{split}/{fault}_s{seed}_{metric}.csv`` with ``timestamp,value,label``
(timestamp = seconds since the run started), and ``{split}/straggler8_s{seed}.csv`` with one
step-time column per rank of an 8-rank run and a ``straggler`` column (the rank, or -1).

    python bench/data/generate.py          # about 5 minutes on 2 cores; rewrites the CSVs
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent
STEPS = 1200
SPLITS = {0: "tune", 1: "tune", 2: "holdout", 3: "holdout"}


@dataclass
class Run:
    """What one run logged: per-metric values, wall-clock stamps, and the labelled fault rows."""

    ts: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    window: tuple[int, int] | None = None  # [start, end) rows of the fault's effect

    def log(self, t0: float, **values: float) -> None:
        self.ts.append(time.perf_counter() - t0)
        for name, value in values.items():
            self.metrics.setdefault(name, []).append(float(value))

    def labels(self) -> np.ndarray:
        label = np.zeros(len(self.ts), dtype=int)
        if self.window:
            label[self.window[0] : self.window[1]] = 1
        return label


def _digits(seed: int, label_noise: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    rng = np.random.default_rng(seed)
    noisy = rng.random(len(y)) < label_noise  # a little irreducible loss keeps the curve noisy
    y = np.where(noisy, rng.integers(0, 10, len(y)), y)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def supervised(seed: int, fault: str, onset: int) -> Run:
    """An MLP on digits, Adam with grad clipping at 5; ``fault`` changes one thing."""
    torch.manual_seed(seed)
    x, y = _digits(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    lr = 1e-3  # a clean run still improves at the end
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    run, t0 = Run(), time.perf_counter()
    durations = {"nan": 1, "spike": 1, "lr100": 30, "drift": 300, "plateau": STEPS, "straggler": 200}
    end = onset + durations.get(fault, 0)
    for step in range(STEPS):
        started = time.perf_counter()
        active = onset <= step < end
        idx = torch.randint(0, len(x), (32,), generator=gen)
        xb, yb = x[idx].clone(), y[idx].clone()
        if active and fault == "nan":
            xb[0, 0] = float("nan")
        if active and fault == "spike":
            xb, yb = xb * 20.0, torch.randint(0, 10, (32,), generator=gen)
        if fault == "drift" and step >= onset:
            noise = min((step - onset) / 300, 1.0) * 0.8  # label noise ramps up to 80%
            flip = torch.rand(32, generator=gen) < noise
            yb = torch.where(flip, torch.randint(0, 10, (32,), generator=gen), yb)
        for group in opt.param_groups:
            group["lr"] = lr * (100 if active and fault == "lr100" else 0 if fault == "plateau" and step >= onset else 1)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if torch.isfinite(grad_norm):
            opt.step()  # a non-finite step is skipped, as a gradient scaler does
        if active and fault == "straggler":
            time.sleep(0.0006)  # about half a step more
        run.log(t0, loss=loss.item(), grad_norm=grad_norm.item(), step_time=time.perf_counter() - started)
    if fault != "clean":
        # NAB's window (10% of the series) after a transient fault; to the end for a lasting one.
        length = {"nan": 120, "spike": 120, "lr100": 120, "straggler": 200}.get(fault, STEPS)
        run.window = (onset, min(onset + length, STEPS))
    return run


def bandit(seed: int, fault: str, onset: int) -> Run:
    """REINFORCE with a running baseline and an entropy bonus on an 8-context, 5-arm Bernoulli bandit."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    arms, dims = 5, 8
    true_w = torch.randn(dims, arms, generator=gen) * 1.5
    policy = torch.nn.Linear(dims, arms)
    lr = 0.02
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    baseline = 0.0
    run, t0 = Run(), time.perf_counter()
    perm = torch.randperm(arms, generator=gen)
    for step in range(STEPS):
        ctx = torch.randn(64, dims, generator=gen)
        payoff = torch.sigmoid(ctx @ true_w)
        if fault == "env_shift" and step >= onset:
            payoff = payoff[:, perm]  # the world changed: what paid now does not
        logits = policy(ctx)
        dist = torch.distributions.Categorical(logits=logits)
        action = dist.sample()
        reward = torch.bernoulli(payoff.gather(1, action[:, None]).squeeze(1), generator=gen)
        advantage = reward - baseline
        bug = fault == "policy_collapse" and onset <= step < onset + 30
        if bug:
            advantage = -advantage  # a sign bug: the policy learns to lose, fast
        for group in opt.param_groups:
            group["lr"] = lr * (20 if bug else 1)
        loss = -(dist.log_prob(action) * advantage).mean() - 0.01 * dist.entropy().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            new = torch.distributions.Categorical(logits=policy(ctx))
            kl = torch.distributions.kl_divergence(dist, new).mean().item()
        baseline = 0.95 * baseline + 0.05 * reward.mean().item()
        run.log(t0, reward=reward.mean().item(), entropy=dist.entropy().mean().item(), kl=kl)
    if fault != "clean":
        run.window = (onset, min(onset + 120, STEPS))
    return run


def straggler8(seed: int, onset: int, rank: int, duration: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Eight data-parallel replicas, each step timed per rank; ``rank`` sleeps 0.6 ms a step for a while."""
    torch.manual_seed(seed)
    x, y = _digits(seed)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)) for _ in range(8)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.002, momentum=0.9) for m in models]
    gen = torch.Generator().manual_seed(seed)
    steps = STEPS // 2
    times, label = np.zeros((steps, 8)), np.full(steps, -1)
    for step in range(steps):
        for r, (model, opt) in enumerate(zip(models, opts)):
            started = time.perf_counter()
            idx = torch.randint(0, len(x), (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if r == rank and onset <= step < onset + duration:
                time.sleep(0.0006)
                label[step] = rank
            times[step, r] = time.perf_counter() - started
    return times, label


def _write(path: Path, ts: list[float], values: list[float], labels: np.ndarray) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["timestamp", "value", "label"])
        for t, v, lab in zip(ts, values, labels.tolist()):
            out.writerow([f"{t:.3f}", f"{v:.5g}", lab])


#: fault -> (run function, metrics worth keeping): each metric where the fault shows, and all of a clean run.
SCENARIOS: dict[str, tuple[Callable[[int, str, int], Run], tuple[str, ...]]] = {
    "clean": (supervised, ("loss", "grad_norm", "step_time")),
    "nan": (supervised, ("loss", "grad_norm")),
    "spike": (supervised, ("loss", "grad_norm")),
    "lr100": (supervised, ("loss", "grad_norm")),
    "drift": (supervised, ("loss",)),
    "plateau": (supervised, ("loss",)),
    "straggler": (supervised, ("step_time",)),
    "rlclean": (bandit, ("reward", "entropy", "kl")),
    "env_shift": (bandit, ("reward",)),
    "policy_collapse": (bandit, ("reward", "entropy", "kl")),
}


def main() -> None:
    torch.set_num_threads(1)
    for seed, split in SPLITS.items():
        folder = HERE / split
        folder.mkdir(exist_ok=True)
        rng = np.random.default_rng(1000 + seed)
        for fault, (fn, metrics) in SCENARIOS.items():
            # A plateau is a fault only while the run should still be improving fast: early.
            low, high = (0.2, 0.3) if fault == "plateau" else (0.35, 0.6)
            onset = int(rng.integers(int(low * STEPS), int(high * STEPS)))
            run = fn(seed, "clean" if fault == "rlclean" else fault, onset)
            for metric in metrics:
                _write(folder / f"{fault}_s{seed}_{metric}.csv", run.ts, run.metrics[metric], run.labels())
            print(f"{split}/{fault}_s{seed}: window {run.window}", flush=True)
        times, label = straggler8(seed, onset=int(rng.integers(150, 350)), rank=int(rng.integers(0, 8)))
        with (folder / f"straggler8_s{seed}.csv").open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["step", *[f"rank{r}" for r in range(8)], "straggler"])
            for step, (row, lab) in enumerate(zip(times.tolist(), label.tolist())):
                out.writerow([step, *[f"{v:.5g}" for v in row], lab])
        print(f"{split}/straggler8_s{seed}", flush=True)


if __name__ == "__main__":
    main()
