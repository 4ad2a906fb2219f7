"""The OpenAPI 3.1 document of ``rankwatch serve`` (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any


def _param(name: str, description: str, schema: dict, where: str = "query", required: bool = False) -> dict:
    return {"name": name, "in": where, "required": required, "description": description, "schema": schema}


RUN = _param("run", "run id", {"type": "string"}, "path", True)
FILTERS = {
    "metric": _param("metric", "only this metric", {"type": "string"}),
    "rank": _param("rank", "only this rank; `all` for the rows merged across ranks",
                   {"oneOf": [{"type": "integer"}, {"const": "all"}]}),
    "steps": _param("steps", "only steps A to B, inclusive (`A:B`, `A:` or `:B`)",
                    {"type": "string", "pattern": "^-?\\d*:-?\\d*$"}),
    "since": _param("since", "only rows written since: Unix seconds, ISO date-time, or an age (`30m`, `2h`, `1d`)",
                    {"type": "string"}),
    "limit": _param("limit", "at most this many rows", {"type": "integer", "minimum": 0}),
}
NUMBER = {"oneOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}]}  # strict JSON, as on the wire

ROLLUP = {"type": "object", "properties": {
    **{k: {"type": "string"} for k in ("run", "metric")},
    "rank": {"type": ["integer", "null"], "description": "null: merged across `ranks` ranks"},
    **{k: {"type": ["integer", "null"]} for k in ("ranks", "start_step", "end_step", "first_step", "last_step",
                                                   "world_size", "count", "nonfinite")},
    **{k: NUMBER for k in ("mean", "std", "min", "max", "last", "p50", "p95", "p99", "ts")},
}}
ALERT = {"type": "object", "description": "an alert transition (docs/contract.md)", "properties": {
    **{k: {"type": "string"} for k in ("key", "status", "run", "severity", "detector", "metric", "message")},
    "rank": {"type": ["integer", "null"]}, "ranks": {"type": "array", "items": {"type": "integer"}},
    **{k: {"type": "integer"} for k in ("step", "incident")}, **{k: NUMBER for k in ("value", "score", "ts")},
}}
RUN_ROW = {"type": "object", "properties": {
    "run": {"type": "string"}, **{k: {"type": ["integer", "null"]} for k in ("first_step", "last_step", "world_size")},
    "alerts": {"type": "integer", "description": "alerts that fired"},
    "firing": {"type": "integer", "description": "conditions firing now"},
    **{k: {"type": ["number", "null"]} for k in ("first_ts", "last_ts")},
}}


def _get(summary: str, schema: dict, params: list[dict] = ()) -> dict:
    return {"get": {"summary": summary, "parameters": list(params), "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
        "400": {"description": "a malformed parameter"}, "401": {"description": "missing or wrong bearer token"}}}}


def _array(item: dict) -> dict:
    return {"type": "array", "items": item}


def openapi() -> dict[str, Any]:
    f = FILTERS
    return {
        "openapi": "3.1.0",
        "info": {"title": "rankwatch report store", "version": "1",
                 "description": "Read-only: rollups, eval reports and alerts of training runs. Floats are strict "
                                "JSON: non-finite values are the strings NaN, Infinity, -Infinity."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
        "paths": {
            "/runs": _get("Runs: first/last step, world size, alert counts", _array(RUN_ROW)),
            "/runs/{run}/metrics": _get("A run's metrics and their window range", _array({"type": "object"}), [RUN]),
            "/runs/{run}/rollups": _get("Rollup windows, per rank and merged across ranks", _array(ROLLUP),
                                        [RUN, f["metric"], f["rank"], f["steps"], f["since"], f["limit"]]),
            "/runs/{run}/eval-reports": _get("Eval reports, the latest revision of each evaluation",
                                             _array({"type": "object", "description": "as in docs/contract.md"}),
                                             [RUN, f["metric"], f["rank"], f["steps"], f["since"]]),
            "/runs/{run}/alerts": _get("Alert transitions", _array(ALERT),
                                       [RUN, f["metric"], f["rank"], f["steps"], f["since"], f["limit"]]),
            "/runs/{run}/forecast": _get("Each eval metric's and rule-watched metric's trend: verdict (plateau, "
                                         "collapse, improving), plateau step, fit and 95% prediction band",
                                         {"type": "object", "properties": {"eval": {"type": "object"},
                                                                           "training": {"type": "object"}}}, [RUN]),
            "/alerts/firing": _get("Alert conditions firing now, every run", _array(ALERT)),
            "/metrics": {"get": {"summary": "Prometheus exposition: latest rollups, firing alerts", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OK"}}}},
        },
    }
