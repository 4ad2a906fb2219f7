"""Alert rules from a TOML file: which detector watches which metric, and the alert policy for it.

The defaults ship as ``rules.default.toml`` beside this module; ``RANKWATCH_RULES`` points a
worker at another file. Parsing is strict: an unknown key, detector or severity is an error
naming the rule, raised when the worker starts rather than silently ignored at run time.
"""

from __future__ import annotations

import fnmatch
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from rankwatch.contract import SEVERITIES
from rankwatch.errors import RankwatchError
from rankwatch.stream_processors import detectors
from rankwatch.stream_processors.detectors import Detector

DEFAULT_RULES_PATH = Path(__file__).with_name("rules.default.toml")
_RULE_KEYS = {"metrics", "exclude", "detector", "params", "severity", "for", "resolve_after", "cooldown"}


class RulesError(RankwatchError, ValueError):
    """A rules file that cannot be used; the message names the rule and the problem."""


def _integer(table: dict, key: str, default: int, where: str) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RulesError(f"{where}: {key} must be a whole number, got {value!r}")
    return value


def _seconds(table: dict, key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RulesError(f"{where}: {key} must be a number of seconds, got {value!r}")
    return float(value)


#: Detectors that see every rank of a run at once; stage 2 runs them, stage 1 skips them.
RUN_SCOPE = frozenset({"crossrank", "stall"})


def detector_classes() -> dict[str, type[Detector]]:
    """Every detector by its ``name``: the names a rules file may use."""
    return dict(detectors.BY_NAME)


@dataclass(frozen=True, kw_only=True)
class Rule:
    metrics: tuple[str, ...]
    detector: str
    exclude: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    severity: str | None = None
    for_: int = 1
    resolve_after: int = 5
    cooldown: int = 0

    def matches(self, metric: str) -> bool:
        def hit(patterns):
            return any(fnmatch.fnmatchcase(metric, p) for p in patterns)

        return hit(self.metrics) and not hit(self.exclude)

    def build(self) -> Detector:
        return detectors.build(self.detector, **self.params)

    def fits(self, stored: Mapping[str, Any]) -> bool:
        """Whether a detector stored as ``stored`` (its ``state_dict``) has this rule's parameters. One
        that has not was built before the rule was edited; it is built afresh, or the edit would reach
        only runs that start after it."""
        return all(k in stored and stored[k] == v for k, v in self.params.items())


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    group_wait_s: float = 1.0
    group_interval_s: float = 2.0
    inhibit: bool = True
    # metric -> its cross-rank rule: stage 2 asks for every metric of every rank's progress, and
    # matching the globs each time was a tenth of its work
    _cross: dict[str, Rule | None] = field(default_factory=dict, init=False, repr=False, compare=False)

    def for_metric(self, metric: str) -> dict[str, Rule]:
        """The per-rank rules that apply to ``metric``, by detector name (first matching rule per detector)."""
        chosen: dict[str, Rule] = {}
        for rule in self.rules:
            if rule.detector not in chosen and rule.detector not in RUN_SCOPE and rule.matches(metric):
                chosen[rule.detector] = rule
        return chosen

    def cross_rank_rule(self, metric: str) -> Rule | None:
        """The first ``crossrank`` rule for ``metric``: stage 1 forwards its values to stage 2."""
        if metric not in self._cross:
            self._cross[metric] = next((r for r in self.rules if r.detector == "crossrank" and r.matches(metric)), None)
        return self._cross[metric]

    @property
    def stall(self) -> Rule | None:
        return next((r for r in self.rules if r.detector == "stall"), None)

    @classmethod
    def from_toml(cls, text: str, source: str = "<rules>") -> Rules:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RulesError(f"{source}: not valid TOML: {exc}") from None
        unknown = set(doc) - {"rule", "grouping"}
        if unknown:
            raise RulesError(f"{source}: unknown section(s) {sorted(unknown)}")
        known = detector_classes()
        rules = []
        for i, raw in enumerate(doc.get("rule", []), 1):
            where = f"{source}: rule {i}"
            extra = set(raw) - _RULE_KEYS
            if extra:
                raise RulesError(f"{where}: unknown key(s) {sorted(extra)}")
            if raw.get("detector") not in known:
                raise RulesError(f"{where}: detector must be one of {sorted(known)}, got {raw.get('detector')!r}")
            if raw.get("severity", "warning") not in SEVERITIES:
                raise RulesError(f"{where}: severity must be one of {SEVERITIES}")
            metrics, exclude = raw.get("metrics"), raw.get("exclude", [])
            if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
                raise RulesError(f"{where}: metrics must be a non-empty list of glob patterns")
            if not isinstance(exclude, list) or not all(isinstance(m, str) for m in exclude):
                raise RulesError(f"{where}: exclude must be a list of glob patterns")
            if not isinstance(params := raw.get("params", {}), dict):
                raise RulesError(f"{where}: params must be a table, such as {{ window = 64 }}")
            rule = Rule(
                metrics=tuple(metrics), exclude=tuple(exclude), detector=raw["detector"], params=dict(params),
                severity=raw.get("severity"), for_=_integer(raw, "for", 1, where),
                resolve_after=_integer(raw, "resolve_after", 5, where), cooldown=_integer(raw, "cooldown", 0, where),
            )
            if rule.for_ < 1 or rule.resolve_after < 1 or rule.cooldown < 0:
                raise RulesError(f"{where}: need for >= 1, resolve_after >= 1, cooldown >= 0")
            try:
                rule.build()  # bad params fail now, with the detector's own message
            except (TypeError, ValueError) as exc:
                raise RulesError(f"{where}: bad params for {rule.detector}: {exc}") from None
            rules.append(rule)
        grouping = doc.get("grouping", {})
        unknown = set(grouping) - {"group_wait_s", "group_interval_s", "inhibit"}
        if unknown:
            raise RulesError(f"{source}: unknown key(s) {sorted(unknown)} in [grouping]")
        group_wait = _seconds(grouping, "group_wait_s", cls.group_wait_s, f"{source}: [grouping]")
        group_interval = _seconds(grouping, "group_interval_s", cls.group_interval_s, f"{source}: [grouping]")
        if group_wait < 0 or group_interval < 0:
            raise RulesError(f"{source}: group_wait_s and group_interval_s must be >= 0")
        inhibit = grouping.get("inhibit", cls.inhibit)
        if not isinstance(inhibit, bool):
            raise RulesError(f"{source}: inhibit must be true or false")
        return cls(tuple(rules), group_wait, group_interval, inhibit)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Rules:
        path = Path(path) if path else DEFAULT_RULES_PATH
        try:
            text = path.read_text()
        except OSError as exc:
            raise RulesError(f"cannot read rules file {path}: {exc}") from None
        return cls.from_toml(text, str(path))


@lru_cache(maxsize=1)
def default_rules() -> Rules:
    return Rules.load()
