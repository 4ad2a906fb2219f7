"""Stream functions: decode, call pure code, send. Nothing here decides anything."""

from __future__ import annotations

import logging
import time

import faust

from rankwatch import contract
from rankwatch.contract import DeadLetter, TelemetryBatch
from rankwatch.errors import SchemaError
from rankwatch.settings import Settings
from stream_processors.processor import RankState, TelemetryProcessor

log = logging.getLogger(__name__)


def _raw_topic(app: faust.App, name: str) -> faust.TopicT:
    return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def register(app: faust.App, settings: Settings) -> None:
    telemetry = _raw_topic(app, contract.TELEMETRY)
    alerts = _raw_topic(app, contract.ALERTS)
    reports = _raw_topic(app, contract.REPORTS)
    deadletter = _raw_topic(app, contract.DEADLETTER)
    # One value per (run, rank), keyed like the telemetry topic so each key has exactly one writer.
    rank_state = app.Table("rank-state", default=None)
    processor = TelemetryProcessor(rollup_steps=settings.rollup_steps)

    async def dead_letter(event: faust.EventT, reason: str) -> None:
        msg = event.message
        log.warning("dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
        letter = DeadLetter(reason, msg.topic, msg.partition, msg.offset, msg.value or b"", time.time())
        await deadletter.send(key=msg.key, value=letter.to_bytes())

    @app.agent(telemetry, name="telemetry")
    async def process_telemetry(stream):
        async for event in stream.events():
            try:
                batch = TelemetryBatch.from_bytes(event.value)
            except SchemaError as exc:
                await dead_letter(event, f"invalid telemetry: {exc}")
                continue
            key = batch.key.decode()
            try:
                state = rank_state.get(key)
                state = state if isinstance(state, RankState) else RankState.from_dict(state)
                if processor.is_replay(state, batch):
                    continue
                out = processor.process(state, batch, time.time())
            except Exception as exc:  # a bug must not stop the worker; the message is kept
                log.exception("processing %s failed", key)
                await dead_letter(event, f"processing failed: {type(exc).__name__}: {exc}")
                continue
            rank_state[key] = state
            for alert in out.alerts:
                await alerts.send(key=alert.key.encode(), value=alert.to_bytes())
            for rollup in out.rollups:
                await reports.send(key=batch.key, value=rollup.to_bytes())
