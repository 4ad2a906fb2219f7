"""One rank of the demo: data-parallel training (torch DDP over gloo, CPU) on scikit-learn's digits.

Run by ``rankwatch demo`` as a separate process per rank. Every ``--eval-every`` steps (before the
first update, and after the last) each rank evaluates its slice of the held-out digits and streams the per-sample
results; the worker merges them into one report with confidence intervals. At ``--nan-step`` rank
``--nan-rank`` feeds a batch with a NaN pixel, as a corrupt shard would: its loss turns NaN, the
all-reduce spreads NaN gradients to every rank, and rankwatch should say so within a step, and
the next evaluation should show the damage as a regression. ``--lr`` sets SGD's learning rate, so two
runs that differ only in it can be compared (``rankwatch report --compare``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

HELD_OUT = 500  # the last samples of digits are the validation set


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--nan-step", type=int, default=-1)
    ap.add_argument("--nan-rank", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    from rankwatch.producers import Evaluator, RankPublisher, TrainerHook, evaluate_shard, shard_dataloader

    x_all, y_all = load_digits_tensors()
    x, y = x_all[:-HELD_OUT][rank::world], y_all[:-HELD_OUT][rank::world]  # this rank's training data
    val = torch.utils.data.TensorDataset(x_all[-HELD_OUT:], y_all[-HELD_OUT:])
    val_loader = shard_dataloader(val, rank=rank, world_size=world, batch_size=64)
    evaluator = Evaluator(freq_steps=args.eval_every, eval_before_train=True)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    publisher = RankPublisher(run=args.run, bootstrap=args.bootstrap)  # rank/world from torch.distributed
    hook = TrainerHook(model, opt, publisher)
    g = torch.Generator().manual_seed(rank)

    def eval_fn(batch):
        xb, yb = batch
        logits = model(xb)
        return {"correct": (logits.argmax(-1) == yb).float(),
                "loss": nn.functional.cross_entropy(logits, yb, reduction="none")}

    for step in range(args.steps):
        if evaluator.should_evaluate(step=step):
            evaluate_shard(eval_fn, val_loader, publisher, step=step, model=model, chunk_size=64)
        idx = torch.randint(len(x), (args.batch_size,), generator=g)
        xb, yb = x[idx], y[idx]
        if step == args.nan_step and rank == args.nan_rank:
            xb = xb.clone()
            xb[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        hook.set_loss(loss)
        opt.step()
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"  rank 0: step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if evaluator.final(step=args.steps):  # the weights the run ends with: periodic triggers stop short
        evaluate_shard(eval_fn, val_loader, publisher, step=args.steps, model=model, chunk_size=64)
    publisher.close()
    stats = publisher.stats()
    if stats.dropped or stats.failed:
        print(f"  rank {rank}: {stats.dropped} dropped, {stats.failed} failed batches", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
