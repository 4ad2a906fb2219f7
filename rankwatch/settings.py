"""Process settings: built once at the entry point from flags and ``RANKWATCH_*``, then passed down.

:meth:`Settings.from_env` reads these settings from the environment; code below the entry points
takes them as arguments. A few places read the environment themselves, each for what it names:
``RankPublisher.from_env`` (the run id from ``RANKWATCH_RUN`` or ``TORCHELASTIC_RUN_ID``, and these
settings), the rank identity that ``RankPublisher`` and the eval sampler fall back on when not given
one (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), the CLI (the webhook's URL and token), and the
plumbing between a supervisor and its workers and between a publisher and its shipper.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from rankwatch.security import KafkaSecurity, read_password

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
FLAVORS = ("auto", "kafka", "tansu")
TELEMETRY_FORMATS = ("binary", "json")


@dataclass(frozen=True, kw_only=True)
class Settings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    #: "tansu" turns on the embedded broker's workarounds; "auto" asks the broker which it is.
    broker_flavor: str = "auto"
    #: Partitions of every rankwatch topic created by rankwatch; more partitions = more workers.
    partitions: int = 8
    #: Replicas of every topic rankwatch creates, Faust's changelogs included: 3 on a 3-broker cluster with
    #: min.insync.replicas 2 (a topic with fewer replicas than that refuses every acks=all write).
    replication_factor: int = 1
    #: Faust consumer-group id; workers with the same id share the partitions.
    app_id: str = "rankwatch"
    #: Seconds after which a worker that stopped heartbeating (killed, hung) loses its partitions to the
    #: others; 0 keeps the client's default (Faust: 60 s; 6 s on Tansu, where joins take half of it).
    #: Apache Kafka accepts 6 s or more (group.min.session.timeout.ms).
    session_timeout_s: float = 0.0
    #: Rollup window length in training steps.
    rollup_steps: int = 50
    #: Seconds a rank or a run may go without new telemetry before workers drop its state (a finished
    #: run, a rank that left): memory stays bounded on a monitor that outlives many jobs. A rank that
    #: comes back later starts afresh (its detectors warm up again). 0 keeps state for good.
    state_ttl_s: float = 3600.0
    #: Seconds between a worker's writes of rank and run state to their changelogs (each key's latest
    #: state once). Longer means less CPU and changelog traffic (at 1,024 ranks a rank's state is about
    #: 60 KB: 12 MB/s of changelog at 5 s); a worker that crashes replays up to this much telemetry,
    #: and the consumer group's committed offsets trail by as much (acks wait for the state).
    state_write_s: float = 15.0
    #: Where workers keep local state (Faust's data dir).
    data_dir: str = ".rankwatch"
    #: The report store: empty means SQLite at ``<data_dir>/store.db``; ``postgresql://…`` uses PostgreSQL.
    store_url: str = ""
    #: Where publishers spool messages for their shipper process; empty means the system's temp dir.
    spool_dir: str = ""
    #: How publishers encode telemetry: "binary" (schema 2, columnar msgpack) or "json" (schema 1, for
    #: readers that only know JSON). Workers read both (docs/contract.md).
    telemetry_format: str = "binary"
    #: Alert rules file (TOML); empty means the defaults shipped with rankwatch.
    rules: str = ""
    #: Seconds after an evaluation's first shard before it is reported with ``complete: false``.
    eval_deadline_s: float = 60.0
    #: At most one provisional (or amended) eval report per evaluation in this many seconds.
    eval_provisional_interval_s: float = 1.0
    #: The metric whose CI drives early stopping and eval-interval advice.
    eval_primary_metric: str = "correct"
    #: Advise stopping an evaluation when the primary metric's 95% CI half-width is at most this.
    eval_ci_target: float = 0.01
    #: ... but never before this many samples.
    eval_min_samples: int = 200
    #: Significance level of the cross-rank consistency and regression tests.
    eval_alpha: float = 0.001
    #: Composite score: "metric=weight,…" (weighted sum of metric means).
    eval_composite: str = "correct=1"
    #: Metrics where lower is better (for regression): comma-separated glob patterns.
    eval_lower_is_better: str = "loss,*loss*,*error*,*perplexity*,*_time*,length"
    #: Bounds of the suggested eval interval, in steps.
    eval_interval_min_steps: int = 10
    eval_interval_max_steps: int = 10_000
    #: Kafka client security, for every client rankwatch makes (see ``rankwatch.security``): PLAINTEXT,
    #: SSL, SASL_PLAINTEXT or SASL_SSL; SASL is SCRAM-SHA-256, SCRAM-SHA-512 or PLAIN.
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    #: Never printed (repr leaves it out); or put it in a file named by ``sasl_password_file``.
    sasl_password: str = field(default="", repr=False)
    sasl_password_file: str = ""
    #: The CA that signed the brokers' certificates (empty: the system's CAs); a client certificate and key.
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        if self.broker_flavor not in FLAVORS:
            raise ValueError(f"broker_flavor must be one of {FLAVORS}, got {self.broker_flavor!r}")
        if self.telemetry_format not in TELEMETRY_FORMATS:
            raise ValueError(f"telemetry_format must be one of {TELEMETRY_FORMATS}, got {self.telemetry_format!r}")
        if self.partitions < 1 or self.rollup_steps < 1 or self.replication_factor < 1:
            raise ValueError("partitions, replication_factor and rollup_steps must be >= 1")
        if self.state_ttl_s < 0:
            raise ValueError("state_ttl_s must be >= 0 (0: state is kept for good)")
        if self.state_write_s <= 0:
            raise ValueError("state_write_s must be > 0")
        if 0 < self.state_ttl_s <= self.state_write_s:  # state would expire before it is ever written
            raise ValueError("state_ttl_s must be 0 or longer than state_write_s")
        if self.session_timeout_s < 0:
            raise ValueError("session_timeout_s must be >= 0 (0: the client's default)")
        self.security  # noqa: B018 - checked (and a password file read) here, not at the first client

    @cached_property
    def security(self) -> KafkaSecurity:
        """The Kafka clients' SASL/TLS settings, in one object with a converter per client library."""
        return KafkaSecurity(security_protocol=self.security_protocol, sasl_mechanism=self.sasl_mechanism,
                             username=self.sasl_username,
                             password=read_password(self.sasl_password, self.sasl_password_file),
                             ssl_cafile=self.ssl_cafile, ssl_certfile=self.ssl_certfile, ssl_keyfile=self.ssl_keyfile,
                             ssl_check_hostname=self.ssl_check_hostname)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        """Settings from ``RANKWATCH_<FIELD>`` variables; keyword overrides (e.g. CLI flags) win when not None."""
        env = os.environ if env is None else env
        kwargs = {}
        for name, f in cls.__dataclass_fields__.items():
            raw = overrides.get(name)
            if raw is None:
                raw = env.get(env_name(name))
            if raw is not None:
                kwargs[name] = _parse(raw, f.type, env_name(name))
        return cls(**kwargs)

    def to_env(self) -> dict[str, str]:
        """The environment that makes ``from_env`` in a child process rebuild these settings."""
        return {env_name(name): str(getattr(self, name)) for name in self.__dataclass_fields__}

    def with_(self, **changes) -> Settings:
        return replace(self, **changes)


def env_name(field: str) -> str:
    return f"RANKWATCH_{field.upper()}"


def _parse(raw, type_name: str, where: str):
    if not isinstance(raw, str):
        return raw
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
    except ValueError:
        raise ValueError(f"{where}={raw!r} is not a valid {type_name}") from None
    return raw
