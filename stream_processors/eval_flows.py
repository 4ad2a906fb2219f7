"""Evaluation flows: decode, call the pure code in ``evaluation``, send. Nothing here decides anything.

Two stages, each with one writer per key:

1. ``eval-shards`` (key ``run/eval_id``): all chunks of one evaluation land on one partition, and
   the ``eval-state`` table is keyed the same way. A timer ticks the evaluations of the partitions
   this worker owns (deadlines, throttled reports, retention). Writing a table from a timer needs
   ``use_partitioner=True``; with bytes keys, serialised raw, the producer's partitioner (murmur2,
   like every Kafka client's default) puts each key's changelog on the partition its shards use.
2. ``eval-runs`` (key ``run``): different evaluations of one run may be merged on different
   partitions, so every non-provisional report is re-keyed by run onto an internal topic. There
   the ``eval-runs`` table keeps the run's history; regression and every eval alert of the run are
   decided in one place, and the eval-interval advice too. Its run-wide alerts go out through stage
   2 (as ``RankSignal``s on ``rankwatch.run_events``), whose grouper holds them back while a
   training NaN's page fires; a rank's own go straight to the alerts topic.
"""

from __future__ import annotations

import logging
import time

import faust
from kafka.partitioner.default import murmur2

from rankwatch import contract
from rankwatch.contract import EvalShard, RankSignal, RunUpdate
from rankwatch.contract.topics import EVAL_RUN_EVENTS
from rankwatch.settings import Settings
from rankwatch.stream_processors.evaluation import (
    EvalProcessor,
    EvalState,
    EvalStateError,
    IntervalAdvisor,
    RunState,
    RunTracker,
    ShardRejected,
    StopRule,
    parse_weights,
)
from rankwatch.stream_processors.topics import dead_letterer, decoded, encoded, raw_topic, send_all

log = logging.getLogger(__name__)



def processors(settings: Settings) -> tuple[EvalProcessor, RunTracker]:
    """The pure processors ``settings`` describe; ValueError on a bad setting."""
    lower = frozenset(filter(None, (m.strip() for m in settings.eval_lower_is_better.split(","))))
    merger = EvalProcessor(
        deadline_s=settings.eval_deadline_s,
        provisional_interval_s=settings.eval_provisional_interval_s,
        primary_metric=settings.eval_primary_metric,
        stop_rule=StopRule(target=settings.eval_ci_target, min_samples=settings.eval_min_samples),
        alpha=settings.eval_alpha,
        composite_weights=tuple(parse_weights(settings.eval_composite).items()),
    )
    tracker = RunTracker(
        alpha=settings.eval_alpha, lower_is_better=lower, primary_metric=settings.eval_primary_metric,
        advisor=IntervalAdvisor(min_interval=settings.eval_interval_min_steps,
                                max_interval=settings.eval_interval_max_steps),
    )
    return merger, tracker


def register(app: faust.App, settings: Settings) -> None:
    shards = raw_topic(app, contract.EVAL_SHARDS)
    run_events = raw_topic(app, EVAL_RUN_EVENTS)
    reports = raw_topic(app, contract.REPORTS)
    alerts = raw_topic(app, contract.ALERTS)
    control = raw_topic(app, contract.CONTROL)
    out_topics = {contract.REPORTS: reports, contract.ALERTS: alerts, contract.CONTROL: control,
                  EVAL_RUN_EVENTS: run_events, contract.RUN_EVENTS: raw_topic(app, contract.RUN_EVENTS)}
    evals = app.Table("eval-state", default=None, key_type=bytes, use_partitioner=True)
    runs = app.Table("eval-runs", default=None, key_type=bytes)
    merger, tracker = processors(settings)
    warned_partitioner: list[bool] = []
    unreadable: set[bytes] = set()  # eval states of another release, logged once

    dead_letter = dead_letterer(app)

    def eval_state(key: bytes) -> EvalState:
        state = evals.get(key)
        return state if isinstance(state, EvalState) else EvalState.from_dict(state)

    def messages(out) -> list[tuple[str, bytes, bytes]]:
        return encoded(*out.reports, *out.controls, *out.updates)

    def check_partitioner(key: bytes, partition: int) -> None:
        # The timer writes state to hash(key) % partitions; a producer with another partitioner
        # would split an evaluation's state from its shards after a rebalance. Say so, once.
        expected = (murmur2(key) & 0x7FFFFFFF) % app.conf.topic_partitions
        if expected != partition and not warned_partitioner:
            warned_partitioner.append(True)
            log.error("eval shard %r arrived on partition %d, but its key hashes to %d: producers must use the "
                      "default (murmur2) partitioner, or eval state may be lost on rebalance", key, partition, expected)

    @app.agent(shards, name="eval-shards")
    async def merge_shards(stream):
        async for event, shard in decoded(stream.events(), EvalShard.from_bytes, dead_letter, "eval shard"):
            if event.message.key != shard.key:
                await dead_letter(event, f"invalid eval shard: its key must be {shard.key!r} (run/eval_id), "
                                         f"got {event.message.key[:200]!r}")
                continue
            check_partitioner(shard.key, event.message.partition)
            try:
                state = eval_state(shard.key)
                state.partition = event.message.partition
                out = merger.apply(state, shard, time.time())
                sends = messages(out)
            except ShardRejected as exc:
                await dead_letter(event, f"rejected eval shard: {exc}")
                continue
            except EvalStateError as exc:  # kept until a worker of the release that wrote the state reads it
                await dead_letter(event, f"unreadable eval state: {exc}")
                continue
            except Exception as exc:  # a bug must not stop the worker; the message is kept
                log.exception("merging eval shard %r failed", shard.key)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")
                continue
            if out.changed:
                # Faust buffers this changelog write and may send it after the report below: a worker
                # killed in between replays the shard and sends the same revision again (readers
                # keep the latest revision per evaluation, so they see no change).
                evals[shard.key] = state
            await send_all(out_topics, sends)

    @app.timer(interval=max(0.2, min(1.0, settings.eval_deadline_s / 5)))
    async def tick_evaluations():
        if app.rebalancing:
            return
        owned = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == contract.EVAL_SHARDS}
        now = time.time()
        for key in list(evals.keys()):
            raw = evals.get(key)
            partition = raw.partition if isinstance(raw, EvalState) else (raw or {}).get("partition")
            if partition not in owned:
                continue  # a standby copy; its owner ticks it
            try:
                state = eval_state(key)
                out = merger.tick(state, now)
                sends = messages(out)
            except EvalStateError as exc:
                if key not in unreadable:  # once, not every tick: it stays until its release reads it
                    unreadable.add(key)
                    log.error("evaluation %r: %s; its shards go to the dead-letter topic", key, exc)
                continue
            except Exception:
                log.exception("ticking evaluation %r failed", key)
                continue
            if out.changed or not isinstance(raw, EvalState):
                evals[key] = state  # also keeps a state recovered as a dict decoded, not decoded every tick
            await send_all(out_topics, sends)

    @app.agent(run_events, name="eval-runs")
    async def track_runs(stream):
        async for event, update in decoded(stream.events(), RunUpdate.from_bytes, dead_letter, "eval run update"):
            try:
                key = update.key
                state = runs.get(key)
                state = state if isinstance(state, RunState) else RunState.from_dict(state)
                out = tracker.apply(state, update, time.time())
                # Run-wide alerts go through stage 2's grouper, where a training NaN's page holds them
                # back (``grouping``); a rank's own go out as they are. World size 0: an evaluation says
                # nothing of how many ranks train, which the grouper waits for.
                sends = encoded(*(RankSignal(alert=a, world_size=0) if a.rank is None else a for a in out.alerts),
                                *out.controls)
            except EvalStateError as exc:
                await dead_letter(event, f"unreadable eval state: {exc}")
                continue
            except Exception as exc:
                log.exception("tracking eval run %r failed", key)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")
                continue
            runs[key] = state
            await send_all(out_topics, sends)
