"""What ``TrainerHook`` costs a training step when the model has its process to itself, as in training.

``bench/step_cost.py`` steps three copies of a model in one process, which cancels drift well but
shares one C allocator between them. Whether a CPU loop page-faults its tensors back in each step
depends on that allocator's state, and the hook changes it: it keeps each step's gradients until
the sender thread has read them. So here each model runs in a process of its own, in blocks of
1.5 s, hooked and plain by turns (the hook attached and detached between blocks, then 0.6 s
untimed: the sender thread reads within 0.1 s and sends within 0.5 s, and that work must fall in
the block that caused it). Each pair of neighbouring blocks gives a difference; the interval is a
t interval over those pairs.

Each model runs twice: with glibc's default allocator settings, and with them pinned so that freed
memory stays in the process (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_``; the usual advice for CPU training, hook or no hook). The second shows the
hook's own cost with the allocator's share taken out.

Linux only (``/proc/self/task/*/schedstat``, per-thread ``getrusage``). Nothing is asserted; it
prints a table.

    python bench/step_cost_alone.py [--seconds 40] [--models MODEL ...] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import scipy.stats
import torch
from step_cost import MODELS, PINNED_ALLOCATOR, _Arm, _Clocks, _stride

from rankwatch.producers import RankPublisher
from rankwatch.broker import EmbeddedBroker, free_port

_BLOCK_S, _SETTLE_S = 1.5, 0.6


def child(model: str, seconds: float, bootstrap: str) -> dict:
    """Alternate plain and hooked blocks of one model for ``seconds``; per-block means per step."""
    torch.set_num_threads(1)
    arm, clocks = _Arm(model), _Clocks()
    blocks: dict[str, list[tuple[float, float, float, int]]] = {"plain": [], "hook": []}  # cpu, faults, blocked, steps
    with tempfile.TemporaryDirectory() as spool:
        publisher = RankPublisher(run="step-cost-alone", rank=0, world_size=1, bootstrap=bootstrap, spool_dir=spool)
        for _ in range(30):
            arm.step()
        every = _stride(arm, publisher, 2.0)  # chosen once, as a hook attached afresh starts at 1
        step, block, end = 1, 0, time.monotonic() + seconds
        while time.monotonic() < end or block % 2:  # end on a whole pair
            role = "hook" if block % 2 else "plain"
            if role == "hook":
                arm.attach(publisher, step, every)
            settled = time.perf_counter() + _SETTLE_S
            while time.perf_counter() < settled:
                arm.step()
            faults, (wall, cpu, queued) = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, clocks.read()
            steps = 0
            while time.perf_counter() < wall + _BLOCK_S:
                arm.step()
                steps += 1
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
            wall, cpu, queued = (now - then for now, then in zip(clocks.read(), (wall, cpu, queued)))
            blocks[role].append((cpu / steps, faults / steps, (wall - cpu - queued) / steps, steps))
            if role == "hook":
                step = arm.detach() or step
            block += 1
        publisher.close()
    clocks.close()
    return {**blocks, "every": every}


def _row(model: str, allocator: str, blocks: dict) -> str:
    plain, hook = np.array(blocks["plain"]), np.array(blocks["hook"])
    base = plain[:, 0].mean()
    diffs = (hook[:, 0] - plain[:, 0]) / base
    low, high = scipy.stats.t.interval(0.95, len(diffs) - 1, loc=diffs.mean(), scale=scipy.stats.sem(diffs))
    blocked = (hook[:, 2].mean() - plain[:, 2].mean()) / base
    return (f"| {model} | {allocator} | {blocks['every']} | {int(hook[:, 3].sum()):,} | {base * 1e3:.3f} | {diffs.mean():+.2%} "
            f"[{low:+.2%}, {high:+.2%}] | {plain[:, 1].mean():.0f} | {hook[:, 1].mean():.0f} | {blocked:+.2%} "
            f"| {diffs.mean() + blocked:+.2%} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="seconds per model and allocator setting (default 40)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), metavar="MODEL",
                    help=f"the models to time (default all: {', '.join(map(repr, MODELS))})")
    ap.add_argument("--bootstrap", help="a running broker; default: start the embedded one")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)  # one model, in this process
    args = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.bootstrap)))
        return
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads 1, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    with tempfile.TemporaryDirectory() as tmp:
        broker = None if args.bootstrap else EmbeddedBroker(port=free_port(), log_path=f"{tmp}/broker.log").start()
        bootstrap = args.bootstrap or broker.bootstrap
        rows = []
        try:
            for model in args.models:
                for allocator, env in (("default", {}), ("pinned", PINNED_ALLOCATOR)):
                    print(f"timing {model!r}, allocator {allocator} ({args.seconds:.0f} s)…", file=sys.stderr, flush=True)
                    out = subprocess.run([sys.executable, __file__, "--child", model, "--seconds", str(args.seconds),
                                          "--bootstrap", bootstrap], env={**os.environ, **env},
                                         capture_output=True, text=True, check=True).stdout
                    rows.append(_row(model, allocator, json.loads(out.strip().splitlines()[-1])))
        finally:
            if broker is not None:
                broker.stop()
    print("**One model per process.** Blocks of 1.5 s, hooked and plain by turns; the hook's extra")
    print("CPU time per step as a share of the plain step's [95% t interval over the pairs of blocks];")
    print("the training thread's page faults per step; its extra time blocked (waiting for the GIL);")
    print("and the two added. 'pinned': glibc keeps freed memory instead of returning it to the system.")
    print("'every': the stride the hook chose in a first run alone, then held for the blocks.\n")
    print("| model | allocator | every | steps hooked | plain step CPU (ms) | hook: CPU | page faults, plain "
          "| page faults, hook | extra GIL wait | CPU + GIL wait |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
