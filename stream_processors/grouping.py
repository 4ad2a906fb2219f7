"""Grouping per-rank transitions into one alert per condition of a run (stage 2, keyed by run).

When NaN reaches every rank through the all-reduce, eight ranks fire at one step; the user wants
one alert that lists eight ranks. A group (one detector on one metric of a run) collects the ranks
firing and sends one ``firing`` alert as soon as every rank of the run has been heard from at or
past the step it started (each rank either fired or was fine there), so grouping costs no more
latency than the slowest rank's telemetry. ``group_wait_s`` bounds the wait for a rank that is
silent. Ranks that join later re-send the alert with the longer list, at most once per
``group_interval_s``: the joins within that interval of the last send go out as one update at its
end (the NaN lane pages three ranks at once, and the rest of an all-reduced NaN joins within the
next second: one update, not one alert per joining signal). When the last rank resolves, one
``resolved`` alert names every rank the incident touched.

A NaN should page within a fraction of a second even when the worker is behind on telemetry, so
the publisher also sends a rank's non-finite values on a lane of their own (``UrgentTelemetry``,
``urgent.py``), which arrive here as ``urgent`` signals ahead of the ranks' progress. An urgent
group is due ``urgent_wait_s`` after its first signal (enough for the other ranks' lane signals of
an all-reduced NaN to join it), not when every rank has passed its step; ranks joining after that
first page wait ``group_wait_s`` as usual. Stage 1's own signal for the same transition follows as
a replay. The lane can only move a condition on: an urgent firing for a rank last seen firing, or an
urgent resolution for one that is not, is dropped, and stage 1 says what the lane cannot see.

Signals arrive at least once. Each rank's last applied transition is kept, so a replayed signal
(same or older incident and status) changes nothing and re-emits nothing.

One incident, one page: a NaN reaches loss, grad norm and the weights at one step, and each is
its own condition. Conditions of a run whose incidents start within ``PAGE_STEPS`` of each other
join one page: its alert (the key of its first condition, the highest severity
of all, the ranks that its conditions starting at its earliest step share, or all ranks if none) lists
every metric in ``metrics`` and is re-sent as it grows, as it is when ranks join.
Its message says which ranks it covers, which of them every metric shares, and quotes its first rank.
A page goes out with the conditions already waiting to join it, as one alert (``latest``).
Members that resolve are silent until the last one does; then one ``resolved`` alert closes the
page.

While a page of ``INHIBITORS`` fires (``inhibit``), a page that would open at or after its step
below critical severity is kept, not sent: sent if it still fires when the inhibitor resolves,
silent throughout if it ends first. Run-wide alerts (a stall, an evaluation's finding) need no
grouping over ranks and go out as they come, but inhibit holds them back the same way; an
evaluation's at any severity: evaluating weights that took a NaN or exploded says nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rankwatch.contract import Alert, RankSignal
from rankwatch.stream_processors.groups import Group, RunGroups

if TYPE_CHECKING:
    from rankwatch.stream_processors.rules import Rules

_ORDER = {"firing": 0, "resolved": 1}
_SEVERITY = {"info": 0, "warning": 1, "critical": 2}
#: Conditions starting within this many steps of a page's first one belong to it. A NaN in one rank's
#: batch at step N makes that rank's loss and every rank's gradient NaN at N, and every other rank's
#: loss at N + 1 (their weights took the NaN update). With 0, the loss was a page of its own whenever
#: the other ranks' loss signals arrived before the first rank's: in 2 of 3 demo runs on a busy host.
PAGE_STEPS = 1
#: Detectors whose critical page means the run's numbers are broken from its step on: the weights
#: took a NaN or exploded, so what a later warning sees (a rank computing on NaN slower than its
#: peers, throughput falling) is a symptom. Such a page holds back the run's warnings and infos
#: that start after it while it fires (``inhibit``), as Alertmanager's inhibit rules would.
INHIBITORS = frozenset({"nonfinite", "explode"})
#: The evaluation stage's detectors start so (``eval_nonfinite``, ``eval_regression``, ...): their
#: run-wide alerts reach the grouper as signals so that an inhibitor holds them back.
EVALUATION = "eval_"


@dataclass(frozen=True, kw_only=True)
class Grouper:
    group_wait_s: float = 1.0
    urgent_wait_s: float = 0.05
    group_interval_s: float = 2.0
    inhibit: bool = True

    @classmethod
    def from_rules(cls, rules: Rules) -> Grouper:
        """The grouping that ``rules``' ``[grouping]`` section sets."""
        return cls(group_wait_s=rules.group_wait_s, group_interval_s=rules.group_interval_s, inhibit=rules.inhibit)

    def add(self, state: RunGroups, signal: RankSignal, now: float) -> list[Alert]:
        """Apply one rank's transition; return alerts that are due now."""
        return latest(self._add(state, signal, now))

    def add_all(self, state: RunGroups, signals: list[RankSignal], now: float) -> list[Alert]:
        """Apply transitions that arrived together (one message's), in order; return alerts due now.
        A group that one of them completes is sent once all are in, so that its page carries the
        conditions the others start: rank 2's NaN gradient, the last rank's, would otherwise page
        every rank's gradient before rank 2's NaN loss joined and named it. A group is sent before a
        later signal of its own is applied, and every waiting one before a run-wide signal (which
        an inhibitor among them may hold back), so each group sees what ``add`` one by one sends."""
        out: list[Alert] = []
        complete: list[str] = []  # groups complete, waiting for the rest of the signals
        for signal in signals:
            a = signal.alert
            if a.rank is None or Alert.make_key(a.run, a.detector, a.metric) in complete:
                out += self._flush_complete(state, complete, now)
            out += self._add(state, signal, now, complete)
        return latest(out + self._flush_complete(state, complete, now))

    def _flush_complete(self, state: RunGroups, complete: list[str], now: float) -> list[Alert]:
        out = []
        for gkey in complete:
            out += self._flush(state, gkey, state.groups[gkey], now)
        complete.clear()
        return out

    def _add(self, state: RunGroups, signal: RankSignal, now: float, complete: list[str] | None = None) -> list[Alert]:
        """``add``, but a group this completes goes on ``complete`` for the caller to send, if given."""
        a = signal.alert
        state.world_size = max(state.world_size, signal.world_size)
        gkey = Alert.make_key(a.run, a.detector, a.metric)
        group = state.groups.setdefault(gkey, Group())
        seen = group.last_seen.get(str(a.rank))
        if signal.urgent and (seen is not None and seen[1] == _ORDER["firing"]) == (a.status == "firing"):
            return []  # the lane moves a rank's condition on, never back: stage 1 knows what it missed
        mark = [a.incident, _ORDER[a.status]]
        if seen is not None and mark <= seen:
            return []  # a replay
        group.last_seen[str(a.rank)] = mark
        if a.rank is None:
            return self._run_wide(state, replace(a, key=gkey, ts=now), now)
        if a.status == "firing":
            if a.rank not in group.ranks:
                group.ranks.append(a.rank)
            if a.rank not in group.touched:
                group.touched.append(a.rank)
            if group.first is None or (not group.emitted and a.incident < group.first["incident"]):
                group.first = a.to_dict()  # until sent, the incident is the earliest any rank saw
            if group.pending_since is None:
                group.pending_since, group.pending_step = now, a.step
            group.pending_step = min(group.pending_step, a.step)
            group.urgent = group.urgent or (signal.urgent and not group.emitted)  # its first page only
            if len(group.ranks) >= state.world_size or self._all_past(state, group.pending_step):
                if complete is None:
                    return self._flush(state, gkey, group, now)
                complete.append(gkey)
            return []
        if a.rank not in group.ranks:
            return []
        if len(group.ranks) > 1:
            group.ranks.remove(a.rank)
            return []
        out = self._flush(state, gkey, group, now)  # a burst shorter than group_wait still gets reported
        group.ranks.clear()
        resolved = self._alert(gkey, group, Alert.from_dict(group.first), "resolved", a, now)
        out += self._page_resolved(state, gkey, resolved, now)
        state.groups[gkey] = Group(last_seen=group.last_seen)
        return out

    def progress(self, state: RunGroups, rank: int, step: int, world_size: int, now: float,
                 restarted: bool = False) -> list[Alert]:
        """Stage 1 applied ``rank``'s telemetry up to ``step``; return groups this makes due.
        ``restarted``: the rank's first since it restarted, perhaps from an earlier checkpoint (its
        steps count anew) and, for an elastic job, with fewer ranks (those beyond are waited for no more)."""
        key = str(rank)
        if restarted:
            state.progress.pop(key, None)
            if world_size < state.world_size:
                state.world_size = world_size
                state.progress = {r: s for r, s in state.progress.items() if int(r) < world_size}
        state.world_size = max(state.world_size, world_size)
        if step <= state.progress.get(key, -1):
            return []
        state.progress[key] = step
        out = []
        for gkey, group in state.groups.items():
            if group.pending_since is not None and self._all_past(state, group.pending_step):
                out += self._flush(state, gkey, group, now)
        return latest(out)

    @staticmethod
    def _all_past(state: RunGroups, step: int) -> bool:
        if len(state.progress) < state.world_size:
            return False
        return all(state.progress.get(str(r), -1) >= step for r in range(state.world_size))

    def tick(self, state: RunGroups, now: float) -> list[Alert]:
        """Alerts whose group wait has passed, and pages' unsent changes whose interval has."""
        out = []
        for gkey, group in state.groups.items():
            due = self._due_at(group)
            if due is not None and now >= due:
                out += self._flush(state, gkey, group, now)
        for page in state.pages.values():
            if page.get("unsent") and now >= self._resend_at(page):
                out.append(self._send_kept(page, now))
        return latest(out)

    def due_in(self, state: RunGroups, now: float) -> float | None:
        """Seconds until ``tick`` has something to send (0 if now), None if nothing waits."""
        dues = [due for group in state.groups.values() if (due := self._due_at(group)) is not None]
        dues += [self._resend_at(page) for page in state.pages.values() if page.get("unsent")]
        return max(0.0, min(dues) - now) if dues else None

    def _resend_at(self, page: dict) -> float:
        # Pages stored before "sent_at" went out long ago.
        return page.get("sent_at", -self.group_interval_s) + self.group_interval_s

    @staticmethod
    def _sent(page: dict, alert: Alert, now: float) -> Alert:
        page.update(alert=alert.to_dict(), sent_at=now, unsent=False, sent_severity=alert.severity)
        return alert

    def _send_kept(self, page: dict, now: float) -> Alert:
        """The page's alert as it stands, kept unsent until ``now``: an update its interval held, or
        a page its inhibitor held back."""
        return self._sent(page, replace(Alert.from_dict(page["alert"]), ts=now), now)

    def _due_at(self, group: Group) -> float | None:
        """When a waiting group's wait ends (``tick`` sends it then); None if it does not wait."""
        if group.pending_since is None:
            return None
        return group.pending_since + (self.urgent_wait_s if group.urgent else self.group_wait_s)

    def _flush(self, state: RunGroups, gkey: str, group: Group, now: float) -> list[Alert]:
        group.pending_since, group.urgent = None, False
        if not set(group.ranks) - set(group.emitted) or group.first is None:
            return []  # nothing new since the last alert of this incident
        group.emitted = sorted(set(group.emitted) | set(group.ranks))
        first = Alert.from_dict(group.first)
        out = self._page(state, gkey, self._alert(gkey, group, first, "firing", first, now), first.message, now)
        # Conditions already waiting that would join this page go with it: the signal that completes
        # one group (the last rank's NaN gradient) would otherwise send the page without them (rank
        # 2's NaN loss, in its urgent wait) and update it only an interval later.
        for other_key, other in state.groups.items():
            if other.pending_since is not None and abs(other.pending_step - first.incident) <= PAGE_STEPS:
                out += self._flush(state, other_key, other, now)
        return out

    def _page(self, state: RunGroups, gkey: str, alert: Alert, first_words: str, now: float) -> list[Alert]:
        """The page this firing alert opens or joins, as it is to be (re-)sent; [] if unchanged, or
        if it changed within ``group_interval_s`` of its last send (``tick`` sends it then, with
        whatever else joined meanwhile). ``first_words`` are its condition's first rank's, which a
        page of several metrics quotes."""
        # A condition that fires again while its page is still open (another member keeps it) rejoins
        # it: a new page would share the open one's key, and a receiver that tracks alerts by key
        # would take the open page's resolve for the new one's.
        page = next((p for p in state.pages.values() if gkey in p["members"]), None)
        if page is None:
            page = next((p for p in state.pages.values()
                         if p["active"] and abs(alert.incident - p["incident"]) <= PAGE_STEPS), None)
        if page is None:
            page = state.pages[f"{gkey}@{alert.incident}"] = {
                "incident": alert.incident, "members": [gkey], "active": [gkey], "first": first_words,
                "inhibits": self._inhibits(alert),
            }
            if alert.severity != "critical" and self._held_back(state, alert.incident):
                page["alert"], page["inhibited"] = alert.to_dict(), True
                return []
            return [self._sent(page, alert, now)]
        sent = Alert.from_dict(page["alert"])
        # The page keeps its first member's incident; its message names the earliest step of all (a
        # NaN's gradient at N can join after the other ranks' loss at N + 1).
        page["earliest"] = min(page.get("earliest", page["incident"]), alert.incident)
        if gkey not in page["members"]:
            page["members"].append(gkey)
        if gkey not in page["active"]:
            page["active"].append(gkey)
        metrics = list(dict.fromkeys([*(sent.metrics or (sent.metric,)), alert.metric]))
        # The origin is the ranks that every condition starting at the page's earliest step shares
        # there: a NaN in rank 2's batch makes rank 2's loss and, through the all-reduce, every rank's
        # gradient NaN at step N, and the other ranks' loss at N + 1. Those come later than the NaN,
        # and may reach the worker before rank 2's own signals; counted, they made all ranks shared,
        # or the wrong ones. With none shared, all of them.
        members = page.setdefault("ranks", {sent.key: list(sent.ranks)})
        origins = page.setdefault("origins", {sent.key: _first_step(state, sent.key, sent.ranks, sent.incident)})
        members[gkey], origins[gkey] = list(alert.ranks), _first_step(state, gkey, alert.ranks, alert.incident)
        every = sorted(set.union(*(set(r) for r in members.values())))
        start = min(step for step, _ in origins.values())
        shared = sorted(set.intersection(*(set(r) for step, r in origins.values() if step == start)))
        ranks = tuple(shared or every)
        severity = max(sent.severity, alert.severity, key=_SEVERITY.__getitem__)
        if len(metrics) == 1:
            message = alert.message if sent.key == alert.key else sent.message
        else:  # its own words for where it is, since its ranks change as members join
            where = f"on {_ranks_phrase(every)}" + (f", every metric on {_ranks_phrase(shared)}"
                                                    if shared and shared != every else "")
            # Pages stored before "first" kept the first member's whole message as "message".
            first = page.get("first") or page.get("message") or sent.message
            message = f"{len(metrics)} metrics at step {page['earliest']} ({', '.join(metrics)}) {where}; first: {first}"
        merged = replace(sent, ranks=ranks, rank=ranks[0] if len(ranks) == 1 else None, severity=severity,
                         metrics=tuple(metrics) if len(metrics) > 1 else (), message=message, ts=alert.ts,
                         score=max(sent.score, alert.score))
        page["inhibits"] = page.get("inhibits", False) or self._inhibits(alert)
        if (merged.ranks, merged.metrics, merged.severity, merged.message) == \
                (sent.ranks, sent.metrics, sent.severity, sent.message):
            return []
        if page.get("inhibited") and merged.severity != "critical":
            page["alert"] = merged.to_dict()
            return []
        # A burst of joins is one update; a page that turns more severe (a NaN joining a spike) or
        # was held back until now goes out at once, and so does a join decided with the page's send
        # (one tick flushing its groups one after another): ``latest`` keeps that version only.
        escalated = _SEVERITY[merged.severity] > _SEVERITY[page.get("sent_severity", sent.severity)]
        if (not page.pop("inhibited", False) and not escalated and now != page.get("sent_at")
                and now < self._resend_at(page)):
            page["alert"], page["unsent"] = merged.to_dict(), True
            return []
        return [self._sent(page, merged, now)]

    def _page_resolved(self, state: RunGroups, gkey: str, alert: Alert, now: float) -> list[Alert]:
        """The page's ``resolved`` alert once its last member resolves ([] before that, and for a page
        held back all along), and the pages it held back that still fire."""
        for key, page in list(state.pages.items()):
            if gkey in page["active"]:
                page["active"].remove(gkey)
                if page["active"]:
                    return []
                del state.pages[key]
                if page.get("inhibited"):
                    return []
                sent = Alert.from_dict(page["alert"])
                out = [replace(alert, key=sent.key, detector=sent.detector, metric=sent.metric,
                               severity=sent.severity, metrics=sent.metrics, incident=sent.incident)]
                for other in state.pages.values():  # what it held back, unless another page still does
                    if other.get("inhibited") and not self._held_back(state, other["incident"]):
                        del other["inhibited"]
                        out.append(self._send_kept(other, now))
                for key, held in list(state.held.items()):
                    if not self._held_back(state, held["incident"]):
                        out.append(replace(Alert.from_dict(state.held.pop(key)), ts=now))
                return out
        return [alert]

    def _run_wide(self, state: RunGroups, alert: Alert, now: float) -> list[Alert]:
        """A run-wide alert as it comes, or [] while an inhibitor holds it back (sent if it still
        fires when the inhibitor resolves, silent if it resolves first)."""
        if alert.status == "resolved":
            return [] if state.held.pop(alert.key, None) is not None else [alert]
        if (alert.severity != "critical" or alert.detector.startswith(EVALUATION)) \
                and self._held_back(state, alert.incident):
            state.held[alert.key] = alert.to_dict()
            return []
        return [alert]

    def _inhibits(self, alert: Alert) -> bool:
        return self.inhibit and alert.severity == "critical" and alert.detector in INHIBITORS

    @staticmethod
    def _held_back(state: RunGroups, incident: int) -> bool:
        """Whether a firing page holds back a condition starting at ``incident``."""
        return any(p.get("inhibits") and not p.get("inhibited") and p["incident"] <= incident
                   for p in state.pages.values())

    @staticmethod
    def _alert(gkey: str, group: Group, first: Alert, status: str, at: Alert, now: float) -> Alert:
        ranks = tuple(sorted(group.ranks if status == "firing" else group.touched))
        if len(ranks) == 1:
            message = at.message
        else:
            verb = "firing on" if status == "firing" else "resolved on all of"
            message = f"{_ranks_phrase(ranks)} {verb}: {at.message}"
        return Alert(
            key=gkey, run=first.run, status=status, severity=first.severity, detector=first.detector,
            metric=first.metric, rank=ranks[0] if len(ranks) == 1 else None, step=at.step, value=at.value,
            message=message, ts=now, score=at.score, incident=first.incident, ranks=ranks,
        )


def latest(alerts: list[Alert]) -> list[Alert]:
    """One decision's alerts without the firing versions of a page that a later one in the same
    decision supersedes: a page opened and joined in one tick goes out once, as the tick left it."""
    kept, later = [], set()
    for alert in reversed(alerts):
        if alert.status == "firing":
            if alert.key in later:
                continue
            later.add(alert.key)
        else:
            later.discard(alert.key)
        kept.append(alert)
    return kept[::-1]


def _first_step(state: RunGroups, gkey: str, ranks: tuple[int, ...] | list[int], incident: int) -> list:
    """``[step, ranks]``: a condition's earliest incident among ``ranks`` and those of them it began
    on there (``incident`` and all of them, when none is known)."""
    group = state.groups.get(gkey)
    incidents = {r: seen[0] for r in ranks if group and (seen := group.last_seen.get(str(r)))}
    first = min(incidents.values(), default=incident)
    return [first, [r for r in ranks if incidents.get(r, first) == first]]


def _ranks_phrase(ranks: tuple[int, ...] | list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks ({ranks_text(ranks)})"


def ranks_text(ranks: tuple[int, ...] | list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown if len(ranks) <= limit else f"{shown}, … {len(ranks) - limit} more"
