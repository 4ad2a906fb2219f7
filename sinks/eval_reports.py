"""A run's evaluation reports as ``rankwatch report`` prints them: the latest revision of each.

The reports come from the report store (``rankwatch.sinks.store``); ``latest_reports`` picks the
newest revisions among raw topic values, for a reader of the topic itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rankwatch import contract
from rankwatch.contract import EvalReport

#: The fields of each report that ``rankwatch report --json`` prints, in order.
FIELDS = ("run", "eval_id", "step", "complete", "provisional", "revision", "world_size", "ranks_received",
          "missing_ranks", "n_samples", "metrics", "per_rank", "composite", "coverage")


def latest_reports(values: Iterable[bytes], run: str) -> list[EvalReport]:
    """The newest revision of each evaluation of ``run`` among raw topic values, ordered by step.

    Other kinds on the topic (rollups) and undecodable values are skipped.
    """
    latest: dict[str, EvalReport] = {}
    for value in values:
        try:
            if contract.decode_any(value).get("kind") != EvalReport.KIND:
                continue
            report = EvalReport.from_bytes(value)
        except contract.SchemaError:
            continue
        known = latest.get(report.eval_id)
        if report.run == run and (known is None or report.revision > known.revision):
            latest[report.eval_id] = report
    return sorted(latest.values(), key=lambda r: (r.step, r.eval_id))


def as_json(report: EvalReport) -> dict[str, Any]:
    """A report as ``rankwatch report --json`` prints it (strict JSON: non-finite numbers as names)."""
    d = report.to_dict()
    return {name: d[name] for name in FIELDS}


def format_table(reports: list[EvalReport]) -> str:
    """A readable table: one block per evaluation, one line per metric.

    >>> from rankwatch.contract import EvalReport
    >>> r = EvalReport(run="r", eval_id="step-100", step=100, complete=True, provisional=False, revision=2,
    ...     world_size=4, ranks_received=[0, 1, 2, 3], missing_ranks=[], n_samples=400,
    ...     metrics={"correct": {"n": 400, "mean": 0.9, "std": 0.3, "ci_low": 0.867, "ci_high": 0.925,
    ...     "method": "wilson"}}, per_rank={}, composite=0.9, coverage={}, ts=0.0)
    >>> print(format_table([r]))
    step-100  step 100  complete  rev 2  ranks 4/4  samples 400  composite 0.9
      correct  n=400  mean 0.9  95% CI [0.867, 0.925] (wilson)
    """
    lines = []
    for r in reports:
        state = "provisional" if r.provisional else ("complete" if r.complete else "INCOMPLETE")
        head = (f"{r.eval_id}  step {r.step}  {state}  rev {r.revision}  ranks {len(r.ranks_received)}/{r.world_size}"
                f"  samples {r.n_samples}")
        if r.missing_ranks:
            head += f"  missing ranks {r.missing_ranks}"
        if r.composite is not None:
            head += f"  composite {_num(r.composite)}"
        lines.append(head)
        for name, m in sorted(r.metrics.items()):
            lines.append(f"  {name}  n={m['n']}  mean {_num(m['mean'])}  95% CI [{_num(m['ci_low'])}, "
                         f"{_num(m['ci_high'])}] ({m['method']})")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"
