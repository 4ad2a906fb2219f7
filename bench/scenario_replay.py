"""Replaying recorded telemetry through rankwatch's pure detection pipeline, as the worker runs it.

The same calls, in the same order, as ``rankwatch.stream_processors.flows``, with the broker taken out:
stage 1 (``TelemetryProcessor`` on a ``RankState`` per rank) turns each batch into per-rank alert
transitions and a ``RankProgress``; stage 2 (``Grouper`` and ``RunWatcher`` on one run's state)
groups them and adds the cross-rank and stall alerts; the two timers of the worker (group wait,
every 50 ms; run watches, every second) fire on the replay's clock. Every event that crosses a
topic is encoded and decoded on the way (telemetry already is, by ``read_batches``), so the replay
also checks that it survives the wire.

Time is the recording's: a batch arrives ``TRANSIT_S`` after its producer stamped it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankwatch.contract import (
    RUN_EVENTS, Alert, ProgressBatch, RankProgress, RankSignal, Rollup, SignalBatch, TelemetryBatch,
    decode_run_event,
)
from rankwatch.errors import SchemaError
from rankwatch.stream_processors.batching import process_batch
from rankwatch.stream_processors.grouping import Grouper
from rankwatch.stream_processors.groups import RunGroups
from rankwatch.stream_processors.processor import RankState, TelemetryProcessor
from rankwatch.stream_processors.rules import Rules
from rankwatch.stream_processors.runwatch import RunWatch, RunWatcher

TRANSIT_S = 0.005  # producer -> broker -> stage 1 -> stage 2, per message
GROUP_TICK_S = 0.05  # flows.flush_waiting_groups
WATCH_TICK_S = 1.0  # flows.check_run_watches


@dataclass(frozen=True)
class Emitted:
    alert: Alert
    at: float  # replay clock when stage 2 sent it to the alert topic
    wire_error: str = ""  # why a consumer of the alert topic could not decode it (empty: it can)


class Pipeline:
    """Both stages for one run, on a clock the caller advances."""

    def __init__(self, rules: Rules, run: str):
        self.processor = TelemetryProcessor(rules=rules)
        self.grouper = Grouper.from_rules(rules)
        self.watcher = RunWatcher(rules=rules)
        self.ranks: dict[int, RankState] = {}
        self.groups = RunGroups()
        self.watch = RunWatch(run=run)
        self.emitted: list[Emitted] = []
        self.rollups: list[Rollup] = []  # what stage 1 sent to the reports topic
        self._next_group_tick = self._next_watch_tick = None

    def telemetry(self, batch: TelemetryBatch, now: float) -> None:
        self.advance(now)
        state = self.ranks.setdefault(batch.rank, RankState())
        if self.processor.is_replay(state, batch):
            return
        out = self.processor.process(state, batch, now)
        self.rollups += [Rollup.from_bytes(r.to_bytes()) for r in out.rollups]
        # A message's signals are applied together, as the worker's ``SignalBatch``.
        self._signals([RankSignal(alert=alert, world_size=batch.world_size) for alert in out.alerts], now)
        if out.last_step is not None or batch.final:
            progress = RankProgress(
                run=batch.run, rank=batch.rank, world_size=batch.world_size,
                last_step=-1 if out.last_step is None else out.last_step, ts=batch.ts,
                series=out.cross_rank, final=batch.final,
            )
            self._progress(RankProgress.from_bytes(progress.to_bytes()), now)

    def advance(self, now: float) -> None:
        """Fire the worker's timers due up to ``now``."""
        if self._next_group_tick is None:
            self._next_group_tick, self._next_watch_tick = now + GROUP_TICK_S, now + WATCH_TICK_S
        while min(self._next_group_tick, self._next_watch_tick) <= now:
            if self._next_group_tick <= self._next_watch_tick:
                t, self._next_group_tick = self._next_group_tick, self._next_group_tick + GROUP_TICK_S
                self._emit(self.grouper.tick(self.groups, t), t)
            else:
                t, self._next_watch_tick = self._next_watch_tick, self._next_watch_tick + WATCH_TICK_S
                self._signals([RankSignal(alert=alert, world_size=self.watch.world_size)
                               for alert in self.watcher.tick(self.watch, t)], t)

    def _signal(self, signal: RankSignal, now: float) -> None:
        signal = RankSignal.from_bytes(signal.to_bytes())
        self._emit(self.grouper.add(self.groups, signal, now), now)

    def _signals(self, signals: list[RankSignal], now: float) -> None:
        if len(signals) == 1:
            self._signal(signals[0], now)
        elif signals:
            batch = SignalBatch.from_bytes(SignalBatch(run=signals[0].alert.run, items=tuple(signals)).to_bytes())
            self._emit(self.grouper.add_all(self.groups, list(batch.items), now), now)

    def _progress(self, progress: RankProgress, now: float) -> None:
        self._emit(self.grouper.progress(self.groups, progress.rank, progress.last_step, progress.world_size, now), now)
        # Applied together, as the worker's ``_progress`` and run-watch timer do.
        self._signals([RankSignal(alert=alert, world_size=progress.world_size)
                       for alert in self.watcher.observe(self.watch, progress, now)], now)

    def _emit(self, alerts: list[Alert], now: float) -> None:
        for alert in alerts:
            try:
                self.emitted.append(Emitted(Alert.from_bytes(alert.to_bytes()), now))
            except SchemaError as exc:  # scored as sent, and reported: a sink would dead-letter it
                self.emitted.append(Emitted(alert, now, str(exc)))


class BatchedPipeline(Pipeline):
    """The same, with stage 1 taking telemetry as the worker does: up to ``take`` messages at a time,
    applied by ``batching.process_batch``; its output crosses the wire as encoded messages."""

    def __init__(self, rules: Rules, run: str, take: int):
        super().__init__(rules, run)
        self.take = take
        self.buffer: list[TelemetryBatch] = []

    def telemetry(self, batch: TelemetryBatch, now: float) -> None:
        self.buffer.append(batch)
        if len(self.buffer) >= self.take:
            self.flush(now)

    def flush(self, now: float) -> None:
        self.advance(now)
        load = lambda key: self.ranks.get(int(key.rsplit("/", 1)[1]))  # noqa: E731
        out = process_batch(self.processor, self.buffer, load, now) if self.buffer else None
        self.buffer = []
        if out is None:
            return
        if out.failed:
            raise out.failed[0][1]
        for key, state in out.states.items():  # the table's memory store keeps these objects
            self.ranks[int(key.rsplit("/", 1)[1])] = state
        for topic, _, value in out.messages:
            if topic != RUN_EVENTS:
                self.rollups.append(Rollup.from_bytes(value))
                continue
            event = decode_run_event(value)
            if isinstance(event, RankSignal):
                self._signal(event, now)
            elif isinstance(event, SignalBatch):
                self._signals(list(event.items), now)
            else:
                for item in event.items if isinstance(event, ProgressBatch) else (event,):
                    self._progress(item, now)


def replay(batches: list[TelemetryBatch], rules: Rules, run: str, tail_s: float = 15.0, *,
           take: int = 0) -> list[Emitted]:
    """Every alert stage 2 emits for these batches, then for ``tail_s`` seconds of silence after them.

    ``take`` > 0: stage 1 takes that many messages at a time (``BatchedPipeline``).
    """
    return replay_pipeline(batches, rules, run, tail_s, take=take).emitted


def replay_pipeline(batches: list[TelemetryBatch], rules: Rules, run: str, tail_s: float = 15.0, *,
                    take: int = 0) -> Pipeline:
    pipeline = BatchedPipeline(rules, run, take) if take else Pipeline(rules, run)
    ordered = sorted(batches, key=lambda b: (b.ts, b.rank, b.seq))
    for batch in ordered:
        pipeline.telemetry(batch, batch.ts + TRANSIT_S)
    if isinstance(pipeline, BatchedPipeline):
        pipeline.flush(ordered[-1].ts + TRANSIT_S if ordered else 0.0)
    if ordered:
        pipeline.advance(ordered[-1].ts + tail_s)
    return pipeline
