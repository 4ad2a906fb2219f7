"""A whole simulated training run in the contract's format: telemetry and eval shards of every rank.

Where ``rankwatch.sim`` makes quiet, flat ranks for throughput benches, this makes the shapes a report
draws: a loss that falls at a speed set by the learning rate, eval accuracy and reward that rise to a
plateau (or collapse from ``collapse_step``), a straggler rank, a NaN. Used by the report, comparison,
forecast and replay tests and benches, always through a real broker and worker.

>>> run = TrainingRun(run="r", lr=0.1, ranks=2, steps=40, eval_every=20)
>>> [type(m).__name__ for m in run.records()][:3]
['TelemetryBatch', 'TelemetryBatch', 'TelemetryBatch']
>>> sorted({m.step for m in run.records() if type(m).__name__ == "EvalShard"})
[20, 40]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from rankwatch.contract import EvalShard, Series, TelemetryBatch
from rankwatch.security import PLAINTEXT, KafkaSecurity


@dataclass
class TrainingRun:
    run: str
    lr: float = 0.1
    ranks: int = 4
    steps: int = 200
    eval_every: int = 20
    eval_samples: int = 400
    steps_per_message: int = 10
    straggler: int | None = None  # this rank's compute time is 1.6x the others'
    nan_step: int | None = None  # the loss is NaN on rank 0 at this step
    collapse_step: int | None = None  # accuracy and reward fall from here on
    inconsistent_rank: int | None = None  # this rank's eval accuracy is 0.35 lower at the last evaluation
    seed: int = 0
    step_s: float = 0.05  # the ranks' own clock: seconds between steps in their stamps

    def progress(self, steps: np.ndarray) -> np.ndarray:
        """0 → 1: how far training has come; a higher learning rate gets there sooner."""
        return 1.0 - np.exp(-np.asarray(steps, dtype=float) * self.lr * 0.25)

    def accuracy(self, step: int) -> float:
        acc = 0.2 + 0.7 * float(self.progress(np.array([step]))[0])
        if self.collapse_step is not None and step > self.collapse_step:
            acc -= min(0.6, 0.004 * (step - self.collapse_step))
        return max(0.02, acc)

    def telemetry(self, rank: int, start: int, seq: int, t0: float) -> TelemetryBatch:
        steps = np.arange(start, min(start + self.steps_per_message, self.steps + 1), dtype=np.int64)
        rng = np.random.default_rng((self.seed, rank, start))
        noise = rng.normal(0.0, 1.0, size=(4, steps.size))
        loss = 0.3 + 2.0 * (1.0 - self.progress(steps)) * (1.0 + 0.03 * noise[0])
        if self.nan_step is not None and rank == 0:
            loss[steps == self.nan_step] = math.nan
        compute = 0.040 * (1.6 if rank == self.straggler else 1.0) * (1.0 + 0.02 * np.abs(noise[1]))
        step_time = np.full(steps.size, 0.040 * (1.6 if self.straggler is not None else 1.0) + 0.005)
        series = {
            "loss": loss,
            "grad_norm": 1.0 + 0.5 * (1.0 - self.progress(steps)) * (1.0 + 0.05 * noise[2]),
            "lr": np.full(steps.size, self.lr),
            "reward": np.array([self.accuracy(int(s)) for s in steps]) * 2.0 + 0.05 * noise[3],
            "compute_time_s": compute,
            "step_time_s": step_time,
            "samples_per_s": 32.0 / step_time,
        }
        return TelemetryBatch(run=self.run, rank=rank, world_size=self.ranks, producer=f"simrun:{rank}", seq=seq,
                              ts=t0 + float(steps[-1]) * self.step_s, final=bool(steps[-1] >= self.steps),
                              series={k: Series(steps, np.asarray(v, dtype=float)) for k, v in series.items()})

    def eval_shards(self, step: int, t0: float) -> list[EvalShard]:
        rng = np.random.default_rng((self.seed, 99, step))
        out = []
        for rank in range(self.ranks):
            ids = np.arange(rank, self.eval_samples, self.ranks, dtype=np.int64)
            acc = self.accuracy(step)
            if rank == self.inconsistent_rank and step + self.eval_every > self.steps:
                acc = max(0.0, acc - 0.35)
            correct = rng.binomial(1, acc, size=ids.size).astype(float)
            reward = correct * 2.0 + rng.normal(0.0, 0.3, size=ids.size)
            out.append(EvalShard(run=self.run, eval_id=f"step-{step}", step=step, rank=rank, world_size=self.ranks,
                                 chunk=0, last=True, sample_ids=ids, metrics={"correct": correct, "reward": reward},
                                 ts=t0 + step * self.step_s, dataset_size=self.eval_samples))
        return out

    def records(self, t0: float | None = None) -> list:
        """Every message of the run, in the order the ranks would send them: telemetry per block of steps,
        each evaluation after the block that reaches its step."""
        t0 = time.time() - self.steps * self.step_s if t0 is None else t0
        out: list = []
        for seq, start in enumerate(range(0, self.steps + 1, self.steps_per_message)):
            out += [self.telemetry(rank, start, seq, t0) for rank in range(self.ranks)]
            end = min(start + self.steps_per_message, self.steps + 1)
            out += [s for step in range(start, end) if step > 0 and step % self.eval_every == 0
                    for s in self.eval_shards(step, t0)]
        return out


def send(bootstrap: str, records: list, *, security: KafkaSecurity = PLAINTEXT) -> int:
    """Publish contract records to their topics with their keys (a plain producer, like any client)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, **security.kafka_python())
    try:
        for r in records:
            producer.send(r.TOPIC, r.to_bytes(), key=r.key if isinstance(r.key, bytes) else r.key.encode())
        producer.flush()
    finally:
        producer.close()
    return len(records)
