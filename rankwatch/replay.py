"""Record a run's input and replay it through the workers: back-test new rules on your own past runs.

``record`` reads a run's telemetry and eval shards from ``rankwatch.telemetry`` and
``rankwatch.eval-shards`` (``rankwatch.sinks.reader.read_topic``) into a JSON-lines file: a header line,
then one line per message, in the order the broker took them (Kafka timestamp, then offset), the value
as its JSON object. ``replay`` publishes them again under a new run id, so the running workers process
them as a fresh run with whatever rules they now have, and the report store keeps the outcome beside
the original's (``rankwatch report --run NEW --kind alerts``).

The ranks' own stamps (``ts``) are shifted by one offset so the replay looks recent and keeps the
original spacing: stalls and stragglers are judged by those stamps, so sending faster than the run
went raises no false stall. A new run id is needed because the workers drop what they have already
seen of a (run, rank, producer) sequence.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from rankwatch import contract
from rankwatch.contract import EVAL_SHARDS, TELEMETRY, EvalShard, TelemetryBatch
from rankwatch.errors import RankwatchError
from rankwatch.security import PLAINTEXT, KafkaSecurity

FORMAT = "rankwatch-recording"
VERSION = 1
KINDS = {TelemetryBatch.KIND: TelemetryBatch, EvalShard.KIND: EvalShard}


def record(bootstrap: str, run: str, path: str | Path, *, stop_after_s: float = 120.0,
           security: KafkaSecurity = PLAINTEXT) -> dict[str, int]:
    """Write every telemetry and eval-shard message of ``run`` now on the broker to ``path``; counts by kind."""
    from rankwatch.sinks.reader import read_topic

    folder = Path(path).resolve().parent  # checked before the topics are read, which takes a while
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise RankwatchError(f"cannot write {path}: {folder} is not a writable directory")
    found = []
    for topic in (TELEMETRY, EVAL_SHARDS):
        for rec in read_topic(bootstrap, topic, stop_after_s=stop_after_s, security=security):
            if rec.key is None or not rec.key.decode("utf-8", "replace").startswith(run + "/"):
                continue
            try:
                obj = contract.decode_any(rec.value)
            except contract.SchemaError:
                continue  # undecodable bytes: the worker dead-lettered them; nothing to replay
            if obj.get("run") == run and obj.get("kind") in KINDS:
                found.append((rec.timestamp, topic, rec.partition, rec.offset, obj))
    found.sort(key=lambda r: r[:4])
    counts = {kind: sum(1 for r in found if r[4]["kind"] == kind) for kind in KINDS}
    if not found:
        raise RankwatchError(f"no telemetry or eval shards of run {run!r} on {bootstrap} "
                             "(the embedded broker keeps messages only while it runs)")
    try:
        out = open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise RankwatchError(f"cannot write {path}: {exc.strerror or exc}") from None
    with out:
        out.write(json.dumps({"format": FORMAT, "version": VERSION, "run": run, "recorded_at": time.time(),
                              "counts": counts}) + "\n")
        for ts_ms, topic, partition, offset, obj in found:
            out.write(json.dumps({"topic": topic, "partition": partition, "offset": offset, "ts_ms": ts_ms,
                                  "value": obj}, separators=(",", ":")) + "\n")
    return counts


def read_recording(path: str | Path) -> tuple[dict, Iterator[TelemetryBatch | EvalShard]]:
    """The header and the recorded messages, decoded with the contract (so a bad file fails here)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RankwatchError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RankwatchError(f"{path}: not a rankwatch recording (not text)") from None
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError:
        header = {}
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise RankwatchError(f"{path}: not a rankwatch recording (version {VERSION})")

    def messages():
        for n, line in enumerate(lines[1:], start=2):
            obj = json.loads(line)["value"]
            cls = KINDS.get(obj.get("kind"))
            if cls is None:
                raise RankwatchError(f"{path}:{n}: a {obj.get('kind')!r} message cannot be replayed")
            yield cls.from_bytes(json.dumps(obj).encode())

    return header, messages()


def replay(bootstrap: str, path: str | Path, *, run: str | None = None, now: float | None = None,
           security: KafkaSecurity = PLAINTEXT) -> tuple[str, int]:
    """Publish a recording under ``run`` (default: ``<original>-replay-<HHMMSS>``); (the run id, messages sent)."""
    from kafka import KafkaProducer

    header, messages = read_recording(path)
    new = run or f"{header['run']}-replay-{time.strftime('%H%M%S')}"
    if new == header["run"]:
        raise RankwatchError("replay under the recorded run id would be dropped as already seen: pick another --run")
    messages = list(messages)
    shift = (time.time() if now is None else now) - max(m.ts for m in messages)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1, **security.kafka_python())
    try:
        for m in messages:
            moved = replace(m, run=new, ts=m.ts + shift)
            producer.send(moved.TOPIC, moved.to_bytes(), key=moved.key)
        producer.flush()
    finally:
        producer.close()
    return new, len(messages)
