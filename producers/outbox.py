"""The sender thread's outbox: points already read, waiting to share one telemetry message."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from rankwatch.contract import Series, TelemetryBatch, UrgentTelemetry

MAX_VALUES = 16_384  # per message: ~400 KB of JSON, well under Kafka's default 1 MB message limit

Triple = tuple[int, str, float]  # (step, metric, value)
# Finite points after a NaN that the lane still sends ahead of the next one: more than any rule's
# ``resolve_after`` (5 by default) needs to tell that the condition resolved in between.
LANE_CALM = 32


class Outbox:
    """Read points waiting to go out together, and the numbering (``seq``) of one producer's messages.

    >>> box = Outbox(run="r", rank=0, world_size=1, producer="p")
    >>> box.add([(0, "loss", 1.0), (1, "loss", 0.5)])
    >>> batch = box.take(extra=[(1, "rss_bytes", 2e9)], final=True)
    >>> batch.seq, batch.series["loss"].steps.tolist(), sorted(batch.series), len(box)
    (0, [0, 1], ['loss', 'rss_bytes'], 0)
    """

    def __init__(self, *, run: str, rank: int, world_size: int, producer: str):
        self.run, self.rank, self.world_size, self.producer = run, rank, world_size, producer
        self.since = 0.0  # when the oldest point waiting arrived (time.monotonic())
        self._triples: list[Triple] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._triples)

    def add(self, triples: list[Triple]) -> None:
        if not self._triples:
            self.since = time.monotonic()
        self._triples += triples

    def take(self, extra: Iterable[Triple] = (), *, final: bool = False) -> TelemetryBatch:
        """Every point waiting, and ``extra``, as the next message (``final``: the producer's last)."""
        triples, self._triples = self._triples, []
        batch = self._batch(TelemetryBatch, [*triples, *extra], final=final)
        self._seq += 1
        return batch

    def urgent(self, triples: Iterable[Triple]) -> UrgentTelemetry:
        """``triples`` for the NaN lane; they go out with the next message too, which keeps its number."""
        return self._batch(UrgentTelemetry, triples)

    def _batch(self, kind: type[TelemetryBatch], triples: Iterable[Triple], *, final: bool = False):
        steps: dict[str, list[int]] = defaultdict(list)
        values: dict[str, list[float]] = defaultdict(list)
        for step, name, value in triples:
            steps[name].append(step)
            values[name].append(value)
        return kind(
            run=self.run, rank=self.rank, world_size=self.world_size, producer=self.producer,
            seq=self._seq, ts=time.time(), final=final,
            series={n: Series(np.asarray(steps[n], dtype=np.int64), np.asarray(values[n])) for n in steps},
        )


class LaneTurns:
    """Which points go ahead of the telemetry to the NaN lane (``Outbox.urgent``): each non-finite
    point of a metric that follows finite ones (or none), after the finite points since the metric's
    previous non-finite one, if that was less than ``LANE_CALM`` points ago. The worker tells from
    those whether stage 1 resolved in between.

    >>> lane = LaneTurns()
    >>> [v for _, _, v in lane.turned([(0, "loss", 1.0), (1, "loss", math.nan), (2, "loss", math.nan)])]
    [nan]
    >>> [v for _, _, v in lane.turned([(3, "loss", 2.0), (4, "loss", math.inf)])], bool(lane)
    ([2.0, inf], True)
    """

    def __init__(self) -> None:
        self._since: dict[str, list[Triple]] = {}  # metric -> its finite points since its last non-finite one

    def __bool__(self) -> bool:
        """Whether some metric's recent non-finite point is still followed (finite points then matter)."""
        return bool(self._since)

    def turned(self, triples: Iterable[Triple]) -> list[Triple]:
        turned = []
        for triple in triples:
            name = triple[1]
            calm = self._since.get(name)
            if math.isfinite(triple[2]):
                if calm is not None:
                    calm.append(triple)
                    if len(calm) >= LANE_CALM:
                        del self._since[name]
                continue
            if calm is None:
                turned.append(triple)
            elif calm:
                turned += [*calm, triple]
            self._since[name] = []
        return turned
