"""What one finished evaluation tells the run: its report plus the anomalies found in it.

An evaluation is merged where its shards land (key ``run/eval_id``), but alerts about a run must
have one writer, so every non-provisional report travels on to the run's own partition as a
``RunUpdate``. This record is internal to the processors (an app-internal topic), not part of the
wire contract; it carries the contract's ``EvalReport`` as is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from rankwatch.contract import EvalReport
from rankwatch.contract.codec import decode_tree, dumps, encode_tree
from rankwatch.errors import SchemaError


@dataclass(frozen=True)
class Finding:
    """One anomalous condition seen in one evaluation; becomes an alert if it is not firing yet."""

    detector: str  # eval_consistency, eval_coverage, eval_regression
    metric: str
    rank: int | None
    value: float
    score: float
    severity: str
    message: str


@dataclass(frozen=True)
class RunUpdate:
    """A non-provisional report, its findings, and which (detector, metric) pairs were checked:
    a firing condition resolves only when its check ran again and found nothing."""

    report: EvalReport
    findings: list[Finding] = field(default_factory=list)
    evaluated: list[tuple[str, str]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return dumps({
            "report": self.report.to_dict(),
            "findings": [encode_tree(asdict(f)) for f in self.findings],
            "evaluated": [list(pair) for pair in self.evaluated],
        })

    @classmethod
    def from_bytes(cls, data: bytes) -> RunUpdate:
        try:
            obj = json.loads(data)
            report = EvalReport.from_bytes(dumps(obj["report"]))
            findings = [Finding(**decode_tree(f)) for f in obj["findings"]]
            evaluated = [(d, m) for d, m in obj["evaluated"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise SchemaError(f"invalid run update: {exc}") from None
        return cls(report, findings, evaluated)
