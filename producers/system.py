"""Resource samplers: what a rank costs the machine, read by the publisher's sender thread.

A sampler is any callable returning ``{metric: float}``. The publisher calls its samplers once per
heartbeat, on its own thread, so the training thread never pays for them. Readings come from
``/proc/self/statm`` and ``os.times()`` (stdlib only, no psutil) and, for a CUDA device, from the
caching allocator's counters (host memory reads, no device sync).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping

Sampler = Callable[[], Mapping[str, float]]

log = logging.getLogger(__name__)

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> float | None:
    """Resident set size of this process now (Linux); None where ``/proc`` is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return float(int(f.read().split()[1]) * _PAGE_BYTES)
    except (OSError, IndexError, ValueError):
        return None


class CpuWaitClock:
    """How long the calling thread has waited, runnable, for a CPU: Linux's ``run_delay``.

    ``read()`` is the raw ``/proc/self/task/<tid>/schedstat`` line of the calling thread (cheap
    enough for the training thread: one ``pread`` of an open file, under a microsecond), and
    ``run_delay_s`` turns it into seconds later, on the sender thread. ``owner_wait_s()`` is the same
    clock of the thread that last called ``read()``, in seconds, from any thread (a collective ends on
    the backend's thread). None where the kernel does not keep it (not Linux, or no schedstats): then
    the hook publishes no ``cpu_wait_s``.

    >>> run_delay_s(b"82866161 73699 39\\n")
    7.3699e-05
    """

    def __init__(self) -> None:
        self._tid: int | None = None
        self._fd: int | None = None

    def read(self) -> bytes | None:
        tid = threading.get_native_id()
        if tid != self._tid:  # the first read, or the loop moved to another thread
            self.close()
            self._tid = tid
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                return None
        if self._fd is None:
            return None
        try:
            return os.pread(self._fd, 128, 0)
        except OSError:
            return None

    def owner_wait_s(self) -> float | None:
        fd = self._fd
        if fd is None:
            return None
        try:
            return run_delay_s(os.pread(fd, 128, 0))
        except OSError:  # closed meanwhile (the hook detached)
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tid = None

    __del__ = close


def run_delay_s(raw: bytes) -> float | None:
    """Seconds spent runnable and waiting for a CPU, from a ``schedstat`` line; None if unreadable."""
    fields = raw.split()
    try:
        return int(fields[1]) / 1e9
    except (IndexError, ValueError):
        return None


class ProcessSampler:
    """``rss_bytes`` and ``cpu_percent`` (CPU time over wall time since the previous sample; 100 = one core).

    >>> sampler = ProcessSampler()
    >>> sorted(sampler())
    ['cpu_percent', 'rss_bytes']
    """

    def __init__(self) -> None:
        self._last = (time.monotonic(), self._cpu_s())

    @staticmethod
    def _cpu_s() -> float:
        t = os.times()
        return t.user + t.system

    def __call__(self) -> dict[str, float]:
        now, cpu = time.monotonic(), self._cpu_s()
        then, cpu_then = self._last
        self._last = (now, cpu)
        out = {"cpu_percent": 100.0 * (cpu - cpu_then) / max(now - then, 1e-9)}
        rss = rss_bytes()
        if rss is not None:
            out["rss_bytes"] = rss
        return out


class CudaMemorySampler:
    """``gpu_mem_allocated_bytes``, ``gpu_mem_reserved_bytes`` and ``gpu_mem_peak_bytes`` of one device.

    The peak is the allocator's since the process started (or since the user last reset it); this
    sampler never resets it, so the user's own peak readings stay right.
    """

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        self._cuda = torch.cuda

    def __call__(self) -> dict[str, float]:
        cuda, device = self._cuda, self.device
        return {
            "gpu_mem_allocated_bytes": float(cuda.memory_allocated(device)),
            "gpu_mem_reserved_bytes": float(cuda.memory_reserved(device)),
            "gpu_mem_peak_bytes": float(cuda.max_memory_allocated(device)),
        }


class Samplers:
    """The samplers a publisher reads with each heartbeat. One that fails is switched off, not
    retried every beat, and never stops the others.

    >>> samplers = Samplers([lambda: {"x": 1}, lambda: 1 / 0])
    >>> samplers.read(), len(samplers.read())  # the second failed once (logged) and is gone
    ([('x', 1.0)], 1)
    """

    def __init__(self, samplers: Iterable[Sampler]) -> None:
        self._all = list(samplers)

    def add(self, sampler: Sampler) -> None:
        self._all = [*self._all, sampler]  # a new list: the sender thread may be reading the old one

    def read(self) -> list[tuple[str, float]]:
        readings = []
        for sampler in self._all:
            try:
                readings += [(name, float(value)) for name, value in sampler().items()]
            except Exception:
                log.exception("rankwatch: sampler %r failed; it is switched off", sampler)
                self._all = [s for s in self._all if s is not sampler]
        return readings
