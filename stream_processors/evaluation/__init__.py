"""Distributed evaluation, pure: merge eval shards into reports, test them, advise the trainers.

No Kafka or Faust here (``rankwatch.stream_processors.eval_flows`` wires it up):

- ``stats``: per-metric summaries with a fitting 95% CI (Wilson for 0/1, t otherwise), cross-rank
  consistency, regression between two reports, composite score.
- ``progressive``: when an evaluation may stop early; what eval interval to suggest.
- ``state``: ``EvalState`` / ``EvalProcessor``, one evaluation (key ``run/eval_id``).
- ``runs``: ``RunState`` / ``RunTracker``, a run's evaluations over time (key ``run``).
"""

from rankwatch.stream_processors.evaluation.progressive import IntervalAdvice, IntervalAdvisor, StopRule
from rankwatch.stream_processors.evaluation.runs import RunOutput, RunState, RunTracker
from rankwatch.stream_processors.evaluation.state import (
    EvalOutput,
    EvalProcessor,
    EvalState,
    EvalStateError,
    ShardRejected,
)
from rankwatch.stream_processors.evaluation.stats import (
    Comparison,
    Consistency,
    Summary,
    compare,
    composite,
    consistency,
    parse_weights,
    summarize,
    wilson_interval,
)

__all__ = [
    "Summary", "Consistency", "Comparison", "summarize", "consistency", "compare", "composite",
    "parse_weights", "wilson_interval", "StopRule", "IntervalAdvisor", "IntervalAdvice",
    "EvalState", "EvalStateError", "EvalProcessor", "EvalOutput", "ShardRejected", "RunState", "RunTracker", "RunOutput",
]
