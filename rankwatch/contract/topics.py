"""Topic names: the only place they are spelled."""

TELEMETRY = "rankwatch.telemetry"
EVAL_SHARDS = "rankwatch.eval-shards"
ALERTS = "rankwatch.alerts"
REPORTS = "rankwatch.reports"
CONTROL = "rankwatch.control"
DEADLETTER = "rankwatch.deadletter"
#: The NaN lane: a metric's NaN or infinity that follows finite values, also sent here ahead of
#: its telemetry, so that a worker behind on telemetry still pages (``UrgentTelemetry``).
URGENT = "rankwatch.urgent"
TOPICS = (TELEMETRY, EVAL_SHARDS, ALERTS, REPORTS, CONTROL, DEADLETTER, URGENT)

#: Between the processors' two stages (per-rank, then per-run). Internal: its schema may change
#: between releases, and only rankwatch workers read it.
RUN_EVENTS = "rankwatch.internal.run-events"
#: Finished eval reports re-keyed by run, from the per-evaluation stage to the per-run one.
EVAL_RUN_EVENTS = "rankwatch.internal.eval-runs"
INTERNAL_TOPICS = (RUN_EVENTS, EVAL_RUN_EVENTS)
