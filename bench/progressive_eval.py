"""Progressive evaluation: how many samples the early stop saves, and what it costs in accuracy.

Real per-sample correctness comes from real models trained here with torch on scikit-learn's
bundled datasets (no network): an MLP on half of ``digits`` evaluated on the other half, the same
model on a larger evaluation set of shifted, noisy copies of the held-out digits, and an MLP on
``breast_cancer``. For each of many random orders of the evaluation set (a shuffled validation
set), ``--ranks`` ranks take strided shards (as ``rankwatch.producers.sharding`` does) and stream chunks of
``--chunk`` samples in round-robin order. After every chunk the processors' ``StopRule`` (the
same code the worker runs, with the dataset size known) decides; once it advises a stop every
rank still evaluates ``--overshoot`` more samples (advice in flight) and closes its shard. The
early accuracy is that of every sample received; the full accuracy, that of the whole set.

The issue's goal is at least 37% fewer samples with |Δaccuracy| < 1 point. "goal" below is met
when the mean saving is >= 37% and |Δ| < 1 point in at least 95% of orders. Nothing is asserted.

    python bench/progressive_eval.py --orders 500
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from rankwatch.stream_processors.evaluation import StopRule


def train_mlp(x: np.ndarray, y: np.ndarray, *, hidden: int, epochs: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, int(y.max()) + 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    return model.eval()


def correctness(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return (model(torch.tensor(x, dtype=torch.float32)).argmax(1).numpy() == y).astype(np.float64)


def augmented(images: np.ndarray, copies: int, rng: np.random.Generator) -> np.ndarray:
    """Copies of 8x8 digit images shifted by up to one pixel, with pixel noise."""
    out = []
    for _ in range(copies):
        shifted = np.empty_like(images)
        for i, img in enumerate(images):
            dy, dx = rng.integers(-1, 2, 2)
            shifted[i] = np.roll(np.roll(img, dy, 0), dx, 1)
        out.append(np.clip(shifted + rng.normal(0, 2.0, images.shape), 0, 16))
    return np.concatenate(out)


def datasets(seed: int) -> dict[str, np.ndarray]:
    """Per-sample 0/1 correctness of real models on real evaluation sets."""
    rng = np.random.default_rng(seed)
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.images, digits.target, test_size=0.5, random_state=seed)
    # Trained on the originals plus shifted, noisy copies, so it also reads the copies it is tested on.
    x_fit = np.concatenate([x_tr, augmented(x_tr, 5, rng)]).reshape(-1, 64)
    y_fit = np.tile(y_tr, 6)
    scale = StandardScaler().fit(x_fit)
    model = train_mlp(scale.transform(x_fit), y_fit, hidden=64, epochs=200, seed=seed)
    aug = augmented(x_te, 20, rng)
    cancer = load_breast_cancer()
    c_tr, c_te, cy_tr, cy_te = train_test_split(cancer.data, cancer.target, test_size=0.5, random_state=seed)
    c_scale = StandardScaler().fit(c_tr)
    c_model = train_mlp(c_scale.transform(c_tr), cy_tr, hidden=16, epochs=100, seed=seed)
    return {
        "digits held-out": correctness(model, scale.transform(x_te.reshape(len(x_te), -1)), y_te),
        "digits shifted+noisy x20": correctness(model, scale.transform(aug.reshape(len(aug), -1)),
                                                np.tile(y_te, 20)),
        "breast_cancer held-out": correctness(c_model, c_scale.transform(c_te), cy_te),
    }


def simulate(correct: np.ndarray, rule: StopRule, *, orders: int, ranks: int, chunk: int, overshoot: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Samples used and |early - full| accuracy, one value per random order."""
    n_total, full = correct.size, correct.mean()
    used, error = np.empty(orders), np.empty(orders)
    for o in range(orders):
        values = correct[rng.permutation(n_total)]
        shards = [values[r::ranks] for r in range(ranks)]
        lens = np.array([len(s) for s in shards])
        sums = [np.r_[0, np.cumsum(s)] for s in shards]
        # Row j: what each rank has sent once chunk c of rank r arrived (chunk c of every rank, then c + 1…).
        n_chunks = -(-lens.max() // chunk)
        c, r = np.repeat(np.arange(n_chunks), ranks)[:, None], np.tile(np.arange(ranks), n_chunks)[:, None]
        sent = np.minimum(np.where(np.arange(ranks)[None, :] <= r, (c + 1) * chunk, c * chunk), lens)
        k = sum(sums[q][sent[:, q]] for q in range(ranks))
        n = sent.sum(axis=1)
        stop = np.flatnonzero((n >= rule.min_samples) & (rule.binary_half_widths(k, n, n_total) <= rule.target))
        final = lens if stop.size == 0 else np.minimum(sent[stop[0]] + overshoot, lens)
        used[o] = final.sum()
        error[o] = abs(sum(sums[q][final[q]] for q in range(ranks)) / used[o] - full)
    return used, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=300, help="random evaluation orders per row")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=32, help="samples per EvalShard chunk")
    parser.add_argument("--overshoot", type=int, default=32, help="samples each rank evaluates after the advice")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.02, 0.015, 0.01, 0.0075],
                        help="CI half-width targets (RANKWATCH_EVAL_CI_TARGET)")
    parser.add_argument("--min-samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.perf_counter()
    data = datasets(args.seed)
    rng = np.random.default_rng(args.seed)
    print(f"{args.orders} random orders per row, {args.ranks} ranks, chunks of {args.chunk}, overshoot "
          f"{args.overshoot}/rank, min_samples {args.min_samples}\n")
    header = (f"{'evaluation set':26} {'N':>6} {'acc %':>6} {'target':>7} {'used %':>7} {'saved %':>8} "
              f"{'mean|Δ|':>8} {'p95|Δ|':>7} {'max|Δ|':>7} {'|Δ|<1pt':>8}  goal")
    print(header)
    print("-" * len(header))
    for name, correct in data.items():
        for target in args.targets:
            rule = StopRule(target=target, min_samples=args.min_samples)
            used, error = simulate(correct, rule, orders=args.orders, ranks=args.ranks, chunk=args.chunk,
                                   overshoot=args.overshoot, rng=rng)
            saved = 1 - used.mean() / correct.size
            within = np.mean(error < 0.01)
            goal = "met" if saved >= 0.37 and within >= 0.95 else "-"
            print(f"{name:26} {correct.size:6d} {100 * correct.mean():6.2f} {target:7.4f} "
                  f"{100 * used.mean() / correct.size:7.1f} {100 * saved:8.1f} {100 * error.mean():8.2f} "
                  f"{100 * np.quantile(error, 0.95):7.2f} {100 * error.max():7.2f} {100 * within:7.1f}%  {goal}")
    print(f"\n|Δ| in accuracy points; done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
