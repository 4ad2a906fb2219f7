"""Many simulated ranks in the documented telemetry format, shared by tests and benches.

``QuietRanks`` builds the messages N healthy ranks would publish: M metrics each, one message per
rank per tick holding ``steps_per_message`` consecutive steps, encoded exactly as the contract says
(``TelemetryBatch.to_bytes``), keyed by (run, rank). Values are quiet on purpose: a level per
(rank, metric) plus *bounded* noise (uniform, ±0.5%), so no detector has a reason to fire on
them and any alert on a quiet rank is a false one. With ``shape="training"`` the loss and grad norm
fall as in a real run (three times their level at step 0, decaying over a few thousand steps), which
the detectors follow with a line instead of a rolling median. Faults are opt-in per (rank, step): ``nan``,
``spike`` (the value times 50) and ``slow`` (compute time times 1.5: a straggler).

``paced`` publishes ticks at a rate through a plain producer (not the worker's code), as a separate
process of the cluster would; the benches run one rank through the real ``RankPublisher`` beside it.

>>> sim = QuietRanks(run="r", ranks=2, metrics=4)
>>> [key for key, _ in sim.messages(0)]
[b'r/0', b'r/1']
>>> sorted(TelemetryBatch.from_bytes(sim.messages(0)[0][1]).series)
['compute_time_s', 'grad_norm', 'loss', 'samples_per_s']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from rankwatch.contract import TELEMETRY, Series, TelemetryBatch
from rankwatch.security import PLAINTEXT, KafkaSecurity

#: The first metrics are the ones the default rules watch (spike, blowup, cross-rank, throughput);
#: the rest are plain gauges, as trainers log dozens of (per-layer norms, memory, learning rate).
NAMED_METRICS = ("loss", "grad_norm", "compute_time_s", "samples_per_s", "data_wait_s", "lr", "mem_gb")

SHAPES = ("flat", "training")
#: What falls in the "training" shape, and over how many steps it falls by a factor e.
FALLING = ("loss", "grad_norm")
DECAY_STEPS = 2000.0


def metric_names(m: int) -> list[str]:
    """``m`` metric names: the named ones first, then ``layer{i}/weight_norm`` gauges."""
    names = list(NAMED_METRICS[:m])
    return names + [f"layer{i:02d}/weight_norm" for i in range(m - len(names))]


@dataclass
class QuietRanks:
    run: str
    ranks: int
    metrics: int = 32
    steps_per_message: int = 1
    first_rank: int = 0  # ranks first_rank .. first_rank + ranks - 1 of ``world_size``
    world_size: int = 0  # 0: ``ranks``
    seed: int = 0
    producer: str = "sim"
    binary: bool = False  # the columnar form (schema 2), as ``RankPublisher`` writes, instead of JSON
    shape: str = "flat"  # or "training": loss and grad norm decay (see above)
    #: (rank, step) -> "nan" | "spike" | "slow"; applied to the first metric ("slow": compute_time_s)
    faults: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.world_size = self.world_size or self.first_rank + self.ranks
        self.names = metric_names(self.metrics)
        rng = np.random.default_rng(self.seed)
        # one level per (metric), the same on every rank (ranks of one job agree), positive
        self.levels = rng.uniform(0.5, 2.0, size=self.metrics)
        if "compute_time_s" in self.names:
            self.levels[self.names.index("compute_time_s")] = 0.2
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, not {self.shape!r}")
        self.falling = [i for i, name in enumerate(self.names) if self.shape == "training" and name in FALLING]

    def values(self, rank: int, tick: int, steps: np.ndarray) -> np.ndarray:
        """(metrics, len(steps)) values of ``rank``: a function of (seed, rank, tick), so replays agree."""
        rng = np.random.default_rng((self.seed, rank, tick))
        out = self.levels[:, None] * (1.0 + rng.uniform(-0.005, 0.005, size=(self.metrics, len(steps))))
        if self.falling:
            out[self.falling] *= 1.0 + 2.0 * np.exp(-steps / DECAY_STEPS)
        for j, step in enumerate(steps.tolist()):
            fault = self.faults.get((rank, step))
            if fault == "nan":
                out[0, j] = np.nan
            elif fault == "spike":
                out[0, j] *= 50.0
            elif fault == "slow" and "compute_time_s" in self.names:
                out[self.names.index("compute_time_s"), j] *= 1.5
        return out

    def batch(self, rank: int, tick: int, *, ts: float | None = None, final: bool = False) -> TelemetryBatch:
        steps = np.arange(tick * self.steps_per_message, (tick + 1) * self.steps_per_message, dtype=np.int64)
        values = self.values(rank, tick, steps)
        return TelemetryBatch(
            run=self.run, rank=rank, world_size=self.world_size, producer=self.producer, seq=tick,
            ts=time.time() if ts is None else ts, final=final,
            series={name: Series(steps, values[i]) for i, name in enumerate(self.names)},
        )

    def messages(self, tick: int, *, ts: float | None = None, final: bool = False) -> list[tuple[bytes, bytes]]:
        """(key, value) of every rank's message for ``tick``."""
        out = []
        for rank in range(self.first_rank, self.first_rank + self.ranks):
            b = self.batch(rank, tick, ts=ts, final=final)
            out.append((b.key, b.to_bytes(binary=self.binary)))
        return out


def produce(bootstrap: str, messages: Iterable[tuple[bytes, bytes]], *, topic: str = TELEMETRY,
            security: KafkaSecurity = PLAINTEXT) -> int:
    """Send (key, value) pairs with a plain kafka-python producer; return how many were sent."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=1 << 20, max_request_size=4 << 20,
                             **security.kafka_python())
    n = 0
    for key, value in messages:
        producer.send(topic, value, key=key)
        n += 1
    producer.flush()
    producer.close()
    return n


def paced(bootstrap: str, sims: list[QuietRanks], *, hz: float, ticks: int,
          stop: Callable[[], bool] = lambda: False, security: KafkaSecurity = PLAINTEXT) -> int:
    """Publish one message per rank per tick, ``hz`` ticks a second (late ticks are sent at once);
    the last tick is ``final`` (the ranks close their publishers). Returns messages sent."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=1 << 20, **security.kafka_python())
    started, sent = time.perf_counter(), 0
    try:
        for tick in range(ticks):
            delay = started + tick / hz - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if stop():
                break
            for sim in sims:
                for key, value in sim.messages(tick, final=tick == ticks - 1):
                    producer.send(TELEMETRY, value, key=key)
                    sent += 1
            producer.flush()
    finally:
        producer.close()
    return sent
