"""The clocks and statistics of ``bench/step_cost.py``: per-thread CPU and run-queue time from Linux's
``/proc/*/task/*/schedstat``, and bootstrap intervals over paired rounds. Linux only.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import scipy.stats


def cpu_ns(pid: int | str) -> dict[str, int]:
    """CPU nanoseconds of each thread of process ``pid`` (or "self"), from ``/proc/PID/task/*/schedstat``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            pass
    return out


def spent_ns(before: dict[str, int], after: dict[str, int], tids) -> int:
    return sum(after.get(t, 0) - before.get(t, 0) for t in tids)


class Clocks:
    """Wall, CPU and run-queue time of the calling (training) thread, in seconds.

    Run-queue time (``/proc/self/task/TID/schedstat``) is the time the thread could have run but the
    kernel gave its core to another thread or process. ``wall - CPU - queued`` is then the time it
    was blocked: a training thread does no I/O, so that is waiting for the GIL.
    """

    def __init__(self) -> None:
        self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

    def read(self) -> tuple[float, float, float]:
        queued = int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        return time.perf_counter(), time.thread_time(), queued

    def close(self) -> None:
        os.close(self._fd)


def cpu_times() -> list[int]:
    """The machine's CPU time so far by kind (user, nice, system, idle, iowait, irq, softirq, steal, …)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def paired_ratio(x: np.ndarray, a: np.ndarray, stat, block: int) -> tuple[str, float, float]:
    """``stat(x - a) / stat(a)`` over paired rounds, with a 95% interval from a block bootstrap:
    whole runs of ``block`` consecutive rounds are resampled, because the machine's speed drifts
    over seconds and rounds close in time are not independent (resampling single rounds gave A/A
    intervals that excluded zero). As text, and the estimate and the interval's upper end."""
    def ratio(x, a):
        return stat(x - a, axis=-1) / stat(a, axis=-1)

    n = len(x) // block
    xb, ab = x[: n * block].reshape(n, block), a[: n * block].reshape(n, block)
    picks = np.random.default_rng(0).integers(0, n, size=(2000, n))
    samples = ratio(xb[picks].reshape(2000, -1), ab[picks].reshape(2000, -1))
    low, high = np.percentile(samples, [2.5, 97.5])
    return f"{ratio(x, a):+.2%} [{low:+.2%}, {high:+.2%}]", float(ratio(x, a)), float(high)


def mean_ci(x: np.ndarray, chunks: int = 20) -> tuple[float, float]:
    """The mean of ``x`` and the upper end of its bootstrap 95% interval, resampling runs of
    consecutive values (one burst of the sender's work spans several steps)."""
    parts = np.array_split(x, chunks)
    sums, counts = np.array([p.sum() for p in parts]), np.array([len(p) for p in parts], dtype=float)

    def mean(s, c, axis=-1):
        return s.sum(axis=axis) / c.sum(axis=axis)

    ci = scipy.stats.bootstrap((sums, counts), mean, paired=True, vectorized=True, n_resamples=2000,
                               method="percentile", random_state=np.random.default_rng(0)).confidence_interval
    return float(np.mean(x)), float(ci.high)
