"""evaluate_shard: run a user's eval function over this rank's shard and stream the results.

The eval function takes one batch and returns per-sample values, one array or tensor per metric
(``{"correct": ..., "length": ...}``, any names). Sample ids come from the shard's sampler, so the
function never handles them. Results go out as ``EvalShard`` chunks of ``chunk_size`` samples
while evaluation runs (``chunk`` 0, 1, …; ``last`` on the final one), which lets the processors
report progressively and advise an early stop; given a ``ControlListener``, the helper follows
that advice between batches and still closes the shard with a ``last`` chunk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader

from rankwatch.producers.evaluation import default_eval_id
from rankwatch.producers.publisher import RankPublisher
from rankwatch.producers.sharding import EvalShardSampler
from rankwatch.contract import EvalShard

log = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, torch.float16: torch.float16,
}


class StopAdvice(Protocol):
    """What the helper needs from a control listener (``rankwatch.producers.ControlListener`` has it)."""

    def should_stop(self, eval_id: str) -> bool: ...


@dataclass(frozen=True)
class ShardResult:
    """What one rank evaluated: ``sample_ids`` and ``metrics`` aligned, in evaluation order."""

    eval_id: str
    step: int
    rank: int
    world_size: int
    shard_size: int  # samples assigned to this rank
    sample_ids: np.ndarray
    metrics: dict[str, np.ndarray]
    chunks: int  # EvalShard messages handed to the publisher
    stopped_early: bool

    @property
    def n_evaluated(self) -> int:
        return len(self.sample_ids)


def evaluate_shard(
    eval_fn: Callable[[Any], Mapping[str, Any]],
    loader: DataLoader,
    publisher: RankPublisher | None,
    *,
    step: int,
    eval_id: str | None = None,
    model: torch.nn.Module | None = None,
    chunk_size: int = 256,
    autocast: str | torch.dtype | None = None,
    device_type: str | None = None,
    control: StopAdvice | None = None,
) -> ShardResult:
    """Evaluate this rank's shard under ``torch.no_grad()`` and publish it in chunks.

    ``loader`` comes from ``shard_dataloader`` (its sampler says which global ids each batch holds).
    ``model``, when given, is put in eval mode and restored afterwards. ``autocast`` (``"bf16"`` or
    ``"fp16"``) runs under ``torch.autocast`` on ``device_type`` (default: the model's device, else
    cpu) when the device supports it, else in full precision with a warning. ``eval_id`` defaults
    to ``step-{step}``, so re-running the same evaluation after a restart dedups downstream.
    ``publisher=None`` evaluates without publishing (e.g. to collect data for a benchmark).
    """
    sampler = loader.sampler
    if not isinstance(sampler, EvalShardSampler):
        raise TypeError("evaluate_shard needs a loader from shard_dataloader() (its sampler is an EvalShardSampler)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if publisher is not None and (publisher.rank, publisher.world_size) != (sampler.rank, sampler.world_size):
        raise ValueError(
            f"publisher is rank {publisher.rank}/{publisher.world_size} but the shard is "
            f"rank {sampler.rank}/{sampler.world_size}"
        )
    eval_id = default_eval_id(step) if eval_id is None else eval_id
    ids, batch_size = sampler.indices, loader.batch_size or 1
    stream = _ChunkStream(publisher, chunk_size, eval_id, step, sampler)
    stopped = False
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    try:
        with torch.no_grad(), _autocast(autocast, device_type or _device_type(model)):
            for i, batch in enumerate(loader):
                batch_ids = ids[i * batch_size : (i + 1) * batch_size]
                stream.add(batch_ids, _per_sample(eval_fn(batch), len(batch_ids), stream.names))
                if stream.done < len(ids) and control is not None and control.should_stop(eval_id):
                    stopped = True
                    break
    finally:
        if model is not None:
            model.train(was_training)
    stream.finish()
    if stopped:
        log.info("rankwatch: %s stopped early on advice after %d of %d samples", eval_id, stream.done, len(ids))
    return ShardResult(
        eval_id=eval_id, step=step, rank=sampler.rank, world_size=sampler.world_size, shard_size=len(ids),
        sample_ids=stream.all_ids(), metrics=stream.all_metrics(),
        chunks=stream.chunk, stopped_early=stopped,
    )


class _ChunkStream:
    """Buffers per-sample results and sends every ``chunk_size`` of them as one EvalShard."""

    def __init__(self, publisher, chunk_size, eval_id, step, sampler: EvalShardSampler):
        self.publisher, self.chunk_size, self.eval_id, self.step = publisher, chunk_size, eval_id, step
        self.sampler = sampler
        self.names: tuple[str, ...] | None = None
        self.pending_ids: list[np.ndarray] = []
        self.pending: dict[str, list[np.ndarray]] = {}
        self.sent_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        self.sent_metrics: dict[str, list[np.ndarray]] = {}
        self.done = 0  # samples evaluated
        self.sent = 0  # samples sent
        self.chunk = 0  # next chunk number
        self.closed = False  # the last chunk went out

    def add(self, batch_ids: np.ndarray, values: dict[str, np.ndarray]) -> None:
        if self.names is None:
            self.names = tuple(values)
            self.pending = {name: [] for name in self.names}
            self.sent_metrics = {name: [np.zeros(0)] for name in self.names}
        self.pending_ids.append(batch_ids)
        for name, array in values.items():
            self.pending[name].append(array)
        self.done += len(batch_ids)
        while self.done - self.sent >= self.chunk_size:
            self._send(self.chunk_size)

    def finish(self) -> None:
        if not self.closed:
            self._send(self.done - self.sent, last=True)

    def all_ids(self) -> np.ndarray:
        return np.concatenate(self.sent_ids)

    def all_metrics(self) -> dict[str, np.ndarray]:
        return {name: np.concatenate(parts) for name, parts in self.sent_metrics.items()}

    def _send(self, n: int, last: bool = False) -> None:
        # Only the unsent tail is concatenated, so streaming stays linear in the shard size.
        ids = np.concatenate([np.zeros(0, dtype=np.int64), *self.pending_ids])
        self.pending_ids = [ids[n:]]
        ids = ids[:n]
        self.sent_ids.append(ids)
        metrics = {}
        for name, parts in self.pending.items():
            values = np.concatenate(parts)
            self.pending[name] = [values[n:]]
            metrics[name] = values[:n]
            self.sent_metrics[name].append(metrics[name])
        self.sent += n
        last = last or self.sent == len(self.sampler)
        if self.publisher is not None:
            self.publisher.send(
                EvalShard(
                    run=self.publisher.run, eval_id=self.eval_id, step=self.step, rank=self.sampler.rank,
                    world_size=self.sampler.world_size, chunk=self.chunk, last=last, sample_ids=ids,
                    metrics=metrics, ts=time.time(), dataset_size=self.sampler.dataset_size,
                )
            )
        self.chunk, self.closed = self.chunk + 1, last


def _per_sample(output: Mapping[str, Any], n: int, names: tuple[str, ...] | None) -> dict[str, np.ndarray]:
    if not isinstance(output, Mapping):
        raise TypeError(f"eval_fn must return a dict of per-sample values, got {type(output).__name__}")
    if names is not None and set(output) != set(names):
        raise ValueError(f"eval_fn returned metrics {sorted(output)}, earlier batches {sorted(names)}")
    values = {}
    for name, value in output.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", torch.float64)
        array = np.asarray(value, dtype=np.float64)
        if array.shape != (n,):
            raise ValueError(
                f"eval_fn returned shape {array.shape} for {name!r} on a batch of {n} samples; "
                "return one value per sample"
            )
        values[name] = array
    return values


def _device_type(model: torch.nn.Module | None) -> str:
    param = next(model.parameters(), None) if model is not None else None
    return param.device.type if param is not None else "cpu"


def _autocast(autocast: str | torch.dtype | None, device_type: str):
    if autocast is None:
        return contextlib.nullcontext()
    dtype = _AUTOCAST_DTYPES.get(autocast)
    if dtype is None:
        raise ValueError(f"autocast must be 'bf16', 'fp16' or None, got {autocast!r}")
    supported = torch.amp.is_autocast_available(device_type)
    if supported and device_type == "cuda":
        supported = torch.cuda.is_available() and (dtype is torch.float16 or torch.cuda.is_bf16_supported())
    if not supported:
        log.warning("rankwatch: %s autocast is not supported on %s; evaluating in full precision", dtype, device_type)
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
