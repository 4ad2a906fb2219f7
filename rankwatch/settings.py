"""Process settings: built once at the entry point from flags and ``RANKWATCH_*``, then passed down.

Library code never reads the environment; only :meth:`Settings.from_env` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
FLAVORS = ("auto", "kafka", "tansu")


@dataclass(frozen=True, kw_only=True)
class Settings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    #: "tansu" turns on the embedded broker's workarounds; "auto" asks the broker which it is.
    broker_flavor: str = "auto"
    #: Partitions of every rankwatch topic created by rankwatch; more partitions = more workers.
    partitions: int = 8
    #: Faust consumer-group id; workers with the same id share the partitions.
    app_id: str = "rankwatch"
    #: Rollup window length in training steps.
    rollup_steps: int = 50
    #: Where workers keep local state (Faust's data dir).
    data_dir: str = ".rankwatch"

    def __post_init__(self) -> None:
        if self.broker_flavor not in FLAVORS:
            raise ValueError(f"broker_flavor must be one of {FLAVORS}, got {self.broker_flavor!r}")
        if self.partitions < 1 or self.rollup_steps < 1:
            raise ValueError("partitions and rollup_steps must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        """Settings from ``RANKWATCH_*`` variables; keyword overrides (e.g. CLI flags) win when not None."""
        env = os.environ if env is None else env
        read = {
            "bootstrap": env.get("RANKWATCH_BOOTSTRAP"),
            "broker_flavor": env.get("RANKWATCH_BROKER_FLAVOR"),
            "partitions": env.get("RANKWATCH_PARTITIONS"),
            "app_id": env.get("RANKWATCH_APP_ID"),
            "rollup_steps": env.get("RANKWATCH_ROLLUP_STEPS"),
            "data_dir": env.get("RANKWATCH_DATA_DIR"),
        }
        read.update({k: v for k, v in overrides.items() if v is not None})
        fields = cls.__dataclass_fields__
        kwargs = {k: int(v) if fields[k].type == "int" else v for k, v in read.items() if v is not None}
        return cls(**kwargs)

    def with_(self, **changes) -> Settings:
        return replace(self, **changes)
