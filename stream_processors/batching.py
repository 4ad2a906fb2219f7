"""Stage 1 over a batch of telemetry messages at once, with the same results as one by one.

The worker takes telemetry in batches (``stream.take``) because per-message costs dominate at
cluster scale (issue 16): Faust's per-event machinery, one changelog write per message and one
``RankProgress`` event per message, which stage 2 then pays for again. Over a batch:

- each rank's state is read once and written once (the last write wins, so the changelog holds
  the same final state; the dedup cursor inside it makes a replay after recovery change nothing);
- the progress of every rank of a run goes out as one ``ProgressBatch``, in the order the
  messages were applied. A rank signal flushes the run's pending progress first, so stage 2 sees
  signals and progress in exactly the order message-by-message processing would send them. A
  message's signals go as one ``SignalBatch``, which stage 2 applies together;
- a message whose processing fails is reported by its index, for the caller to dead-letter; its
  output is dropped and the rest of the batch goes on;
- processed by ``process_in_parts``, the batch yields every few messages, so that a worker can let
  its event loop run (the NaN lane's pages must not wait for a whole batch), with the same output;
- a rank whose stored state this worker cannot read (another release's layout) keeps its dedup
  cursor and learns afresh, and is reported, so that an upgrade never dead-letters a rank's telemetry.

Pure: no Faust, no clock; ``bench/scenario_replay.py`` and the tests call it as the worker does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankwatch.contract import (
    MAX_MESSAGE_BYTES, RUN_EVENTS, SCHEMA_VERSION, MessageTooLarge, ProgressBatch, RankProgress, RankSignal,
    SignalBatch, TelemetryBatch,
)
from rankwatch.stream_processors.processor import RankState, RankStateError, TelemetryProcessor, fit_due_models
from rankwatch.stream_processors.topics import encoded

Message = tuple[str, bytes, bytes]  # (topic, key, value), as ``topics.encoded`` makes them
# Room for the envelope of a ProgressBatch around its items, well above what it takes.
_ENVELOPE_BYTES = 4096
# An int64 step (20 characters), a float (24, as repr writes it) and their separators, with room.
_POINT_BYTES = 64


@dataclass
class Stage1Output:
    messages: list[Message] = field(default_factory=list)  # in send order
    states: dict[str, RankState] = field(default_factory=dict)  # key -> state to write, once
    failed: list[tuple[int, Exception]] = field(default_factory=list)  # (index in the batch, why)
    applied: int = 0  # messages applied (replays and failures not counted)
    unreadable: list[tuple[str, RankStateError]] = field(default_factory=list)  # (key, why): learning afresh
    late: list[tuple[str, int]] = field(default_factory=list)  # (key, seq) of messages applied late (``late``)


def as_state(found: Any) -> RankState:
    """A table value as a ``RankState`` (the memory store keeps the object; a recovered one is a dict)."""
    return found if isinstance(found, RankState) else RankState.from_dict(found)


def _load(key: str, load: Callable[[str], Any], out: Stage1Output) -> RankState:
    found = load(key)
    try:
        return as_state(found)
    except RankStateError as exc:
        out.unreadable.append((key, exc))
        # Written even if every message of the batch is a replay, so that it is read, and reported, once.
        state = out.states[key] = RankState.salvage(found)
        return state


def process_batch(
    processor: TelemetryProcessor, batches: Sequence[TelemetryBatch], load: Callable[[str], Any], now: float,
    partitions: Sequence[int] | None = None,
) -> Stage1Output:
    """Apply ``batches`` in order; ``load(key)`` reads a rank's stored state (None if new);
    ``partitions``: the telemetry partition each came from, which stage 2's stall rule reads."""
    *_, out = process_in_parts(processor, batches, load, now, partitions, part=max(1, len(batches)))
    return out


def process_in_parts(
    processor: TelemetryProcessor, batches: Sequence[TelemetryBatch], load: Callable[[str], Any], now: float,
    partitions: Sequence[int] | None = None, *, part: int,
) -> Iterator[Stage1Output]:
    """``process_batch`` that yields its output so far after every ``part`` messages, for a caller to
    let its event loop run there; the last output yielded is the whole batch's, and the same."""
    out = Stage1Output()
    progress: dict[str, list[RankProgress]] = {}  # run -> progress not sent yet, in order
    learned = []  # the detectors that learned, whose tail models may be due for a refit

    def flush(run: str) -> None:
        out.messages.extend(_progress_messages(run, progress.pop(run, [])))

    for index, batch in enumerate(batches):
        if index and index % part == 0:
            yield out
        try:
            key = batch.key.decode()
            state = out.states.get(key)
            if state is None:
                state = _load(key, load, out)
            if processor.is_replay(state, batch):
                continue
            result = processor.process(state, batch, now)
            signals = _signal_messages(batch.run, [RankSignal(alert=a, world_size=batch.world_size)
                                                   for a in result.alerts])
            rollups = encoded(*result.rollups)
            item = None
            # A late message says nothing of the rank's progress: an earlier incarnation's ``final``
            # comes after the next incarnation began, and must not close the rank.
            if not result.arrived_late and (result.last_step is not None or batch.final or result.restarted):
                item = RankProgress(
                    run=batch.run, rank=batch.rank, world_size=batch.world_size,
                    last_step=-1 if result.last_step is None else result.last_step, ts=batch.ts,
                    series=result.cross_rank, final=batch.final,
                    partition=-1 if partitions is None else partitions[index], restarted=result.restarted)
                if _may_be_too_large(item):
                    encoded(item)  # a progress too large to send fails this message, as it did alone
        except Exception as exc:  # a bug must not stop the worker; the caller dead-letters the message
            out.failed.append((index, exc))
            continue
        out.states[key] = state
        out.applied += 1
        learned += result.learned
        if result.arrived_late:
            out.late.append((key, batch.seq))
        if signals:
            flush(batch.run)
            out.messages.extend(signals)
        if item is not None:
            progress.setdefault(batch.run, []).append(item)
        out.messages.extend(rollups)
    for run in list(progress):
        flush(run)
    fit_due_models(learned)  # once per batch: 100 models fitted together cost what two alone do
    yield out


def _signal_messages(run: str, signals: list[RankSignal]) -> list[Message]:
    """A message's signals as one ``SignalBatch`` (stage 2 applies them together), in parts if
    that is too large to send (thousands of metrics NaN at once); one alone as itself."""
    if len(signals) < 2:
        return encoded(*signals)
    try:
        return encoded(SignalBatch(run=run, items=tuple(signals)))
    except MessageTooLarge:
        half = len(signals) // 2
        return _signal_messages(run, signals[:half]) + _signal_messages(run, signals[half:])


def _may_be_too_large(item: RankProgress) -> bool:
    """Whether ``item`` could exceed the size limit; encoding every one to see cost as much as the
    rest of a quiet one-step message. JSON spends at most ``_POINT_BYTES`` on a step and its value."""
    size = _ENVELOPE_BYTES + sum(len(name) * 6 + 64 + _POINT_BYTES * len(s.steps) for name, s in item.series.items())
    return size > MAX_MESSAGE_BYTES


def _progress_messages(run: str, items: list[RankProgress]) -> list[Message]:
    """``items`` as few ``ProgressBatch`` messages as the size limit allows (one, as a rule)."""
    if not items:
        return []
    if len(items) == 1:  # the plain event, as message-by-message processing sends it
        return encoded(items[0])
    key = run.encode()
    head = json.dumps({"schema": SCHEMA_VERSION, "kind": ProgressBatch.KIND, "run": run},
                      separators=(",", ":"))[:-1].encode() + b',"items":['
    messages, parts, size = [], [], 0
    for item in items:
        part = json.dumps(item.to_dict(), separators=(",", ":"), allow_nan=False).encode()
        if parts and size + len(part) + _ENVELOPE_BYTES > MAX_MESSAGE_BYTES:
            messages.append((RUN_EVENTS, key, head + b",".join(parts) + b"]}"))
            parts, size = [], 0
        parts.append(part)
        size += len(part) + 1
    messages.append((RUN_EVENTS, key, head + b",".join(parts) + b"]}"))
    return messages
