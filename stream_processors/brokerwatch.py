"""The worker's watch on its broker: outages, and a broker that came back empty.

A worker cannot tell from its Kafka client alone that the broker went away and came back with
nothing: the embedded Tansu broker keeps everything in memory, so a restart forgets every topic,
offset and group (an Apache Kafka whose storage was wiped does the same). The clients reconnect,
topics get auto-created with the broker's default partition count, and the worker's tables wait
for a state that is gone. So the worker looks, once a second, at what it knows the broker had:

- a rankwatch topic gone, or with another partition count than the worker started with;
- an end offset of a telemetry partition lower than one seen before (offsets never go back).

Either means a new broker (:func:`new_broker_reason`); the worker then starts over (see
``worker.py``). A broker that does not answer is an outage: the stall clock stops meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiokafka

from rankwatch.security import PLAINTEXT, KafkaSecurity

log = logging.getLogger(__name__)


@dataclass
class BrokerView:
    """What one look at the broker saw: each topic's partition count, and some end offsets."""

    partitions: dict[str, int]
    ends: dict[tuple[str, int], int] = field(default_factory=dict)


def new_broker_reason(expected: Mapping[str, int], high: Mapping[tuple[str, int], int], view: BrokerView) -> str:
    """Why ``view`` is of a broker that forgot what we knew it had ("" if nothing says so).

    ``expected`` is each topic's partition count when the worker started; ``high`` the highest end
    offset seen so far per (topic, partition).
    """
    for topic, count in expected.items():
        found = view.partitions.get(topic)
        if found is None:
            return f"topic {topic} is gone"
        if found != count:
            return f"topic {topic} has {found} partitions, not {count}"
    for tp, end in view.ends.items():
        if end < high.get(tp, 0):
            return f"the end offset of {tp[0]}[{tp[1]}] went back from {high[tp]} to {end}"
    return ""


class BrokerWatch:
    """Look at the broker every ``interval_s``; call ``on_away``/``on_back`` at outages, ``on_new`` once."""

    def __init__(
        self,
        bootstrap: str | list[str],
        expected: Mapping[str, int],
        *,
        offsets_of: tuple[str, ...],
        on_away: Callable[[], None],
        on_back: Callable[[], None],
        on_new: Callable[[str], Awaitable[None]],
        interval_s: float = 1.0,
        timeout_s: float = 3.0,
        security: KafkaSecurity = PLAINTEXT,
    ):
        self.bootstrap, self.expected, self.offsets_of = bootstrap, dict(expected), offsets_of
        self.on_away, self.on_back, self.on_new = on_away, on_back, on_new
        self.interval_s, self.timeout_s, self.security = interval_s, timeout_s, security
        self.high: dict[tuple[str, int], int] = {}
        self.away = False
        self._probe: aiokafka.AIOKafkaConsumer | None = None

    async def run(self) -> None:
        try:
            while True:
                # Look often while away: a returning broker is soon written to by auto-creating clients.
                await asyncio.sleep(self.interval_s / 4 if self.away else self.interval_s)
                try:
                    view = await asyncio.wait_for(self.look(), self.timeout_s)
                except Exception as exc:  # any failure to get an answer is an outage (refused, timed out)
                    await self._drop_probe()
                    if not self.away:
                        log.warning("rankwatch worker: the broker does not answer (%s); stall clocks stop", exc)
                        self.away = True
                        self.on_away()
                    continue
                if self.away:
                    self.away = False
                    self.on_back()
                reason = new_broker_reason(self.expected, self.high, view)
                if reason:
                    await self.on_new(reason)
                    return
                for tp, end in view.ends.items():
                    self.high[tp] = max(end, self.high.get(tp, 0))
        finally:
            await self._drop_probe()

    async def look(self) -> BrokerView:
        if self._probe is None:
            probe = aiokafka.AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                              request_timeout_ms=int(self.timeout_s * 1000), **self.security.aiokafka())
            self._probe = probe  # dropped (and stopped) on failure, a failed start included
            await probe.start()
        # All topics' metadata: asking for named topics could auto-create them (what we look for).
        cluster = await self._probe._client.fetch_all_metadata()
        partitions = {t: len(cluster.partitions_for_topic(t) or ()) for t in cluster.topics()}
        view = BrokerView(partitions)
        tps = [aiokafka.TopicPartition(t, p) for t in self.offsets_of if partitions.get(t) == self.expected.get(t)
               for p in range(partitions[t])]
        if tps:
            # ListOffsets: on Tansu it is the last batch's base + 1, which only grows on a live broker too.
            ends = await self._probe.end_offsets(tps)
            view.ends = {(tp.topic, tp.partition): end for tp, end in ends.items()}
        return view

    async def _drop_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            try:
                await asyncio.wait_for(probe.stop(), self.timeout_s)
            except Exception:  # a probe of a broker that is gone may not stop cleanly; it is dropped anyway
                pass
