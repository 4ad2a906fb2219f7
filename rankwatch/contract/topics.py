"""Topic names: the only place they are spelled."""

TELEMETRY = "rankwatch.telemetry"
EVAL_SHARDS = "rankwatch.eval-shards"
ALERTS = "rankwatch.alerts"
REPORTS = "rankwatch.reports"
CONTROL = "rankwatch.control"
DEADLETTER = "rankwatch.deadletter"
TOPICS = (TELEMETRY, EVAL_SHARDS, ALERTS, REPORTS, CONTROL, DEADLETTER)
