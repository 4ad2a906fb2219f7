"""``rankwatch report --run R --html PATH``: one self-contained HTML file (no network, no CDN).

The page carries its data as JSON and draws it with the small inline script in ``report_js``. Sections:
eval metrics with 95% CI bands, training curves with alert markers, throughput and step time per rank,
a rank × step heatmap, the alert timeline and the eval consistency per rank. ``page`` is shared with the
run comparison (``compare_html``).
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass, field

from rankwatch.sinks.report_data import run_view
from rankwatch.sinks.report_js import SCRIPT, STYLE
from rankwatch.sinks.store_query import Queries

#: Training curves drawn first, when logged; every other metric follows by name.
FIRST_CURVES = ("loss", "grad_norm", "reward", "lr", "update_ratio", "param_norm")


@dataclass
class Section:
    heading: str
    note: str = ""
    charts: list[dict] = field(default_factory=list)
    body: str = ""  # extra HTML (tables), already escaped


def clean(x):
    """JSON-able with nulls for non-finite floats (a gap in a line, not a parse error)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def page(title: str, intro: str, sections: list[Section]) -> str:
    """The whole HTML document: each chart a div that the inline script fills."""
    specs, parts = [], []
    for s in sections:
        parts.append(f"<h2>{html.escape(s.heading)}</h2>")
        if s.note:
            parts.append(f'<p class="note">{html.escape(s.note)}</p>')
        if s.charts:
            parts.append('<div class="grid">')
            for spec in s.charts:
                spec = dict(spec, id=f"chart{len(specs)}")
                specs.append(spec)
                parts.append(f'<div class="chart" id="{spec["id"]}" data-kind="{spec["kind"]}"></div>')
            parts.append("</div>")
        parts.append(s.body)
    data = json.dumps(clean(specs), allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{intro}\n"
            '<ul id="errors"></ul>\n' + "\n".join(parts) +
            f'\n<script id="charts" type="application/json">{data}</script>\n<script>{SCRIPT}</script>\n'
            "</body></html>\n")


def eval_charts(view: dict, forecasts: dict | None = None) -> list[dict]:
    """One chart per eval metric: the mean at each evaluation with its 95% CI band, and the forecast
    (dashed, with its prediction band) when one was made."""
    charts = []
    for name, s in view["eval"].items():
        series = [{"name": name, "x": s["steps"], "y": s["mean"], "lo": s["lo"], "hi": s["hi"], "points": True}]
        title = f"eval {name} (95% CI)"
        f = (forecasts or {}).get(name)
        if f and f.get("steps"):
            series.append({"name": "forecast", "x": f["steps"], "y": f["mean"], "lo": f["lo"], "hi": f["hi"],
                           "dash": True, "forecast": True, "color": "#888"})
            title += f": {f['verdict']}"
        charts.append({"kind": "line", "title": title, "series": series})
    return charts


def curve_charts(view: dict, forecasts: dict | None = None) -> list[dict]:
    """One chart per logged metric (run-wide mean and p95 per window), its alerts as markers, and the forecast
    of a metric a rule watches."""
    names = sorted(view["curves"], key=lambda m: (FIRST_CURVES.index(m) if m in FIRST_CURVES else len(FIRST_CURVES), m))
    charts = []
    for name in names:
        s = view["curves"][name]
        markers = [{"x": a["step"], "severity": a["severity"],
                    "text": f"{a['severity']} {a['detector']} at step {a['step']}: {a['message']}"}
                   for a in view["alerts"] if a["metric"] == name and a["status"] == "firing"]
        series = [{"name": "mean", "x": s["steps"], "y": s["mean"]}]
        if any(v is not None and math.isfinite(v) for v in s["p95"]):
            series.append({"name": "p95", "x": s["steps"], "y": s["p95"], "dash": True})
        title = name + (f" ({len(markers)} alerts)" if markers else "")
        f = (forecasts or {}).get(name)
        if f and f.get("steps"):
            series.append({"name": "forecast", "x": f["steps"], "y": f["mean"], "lo": f["lo"], "hi": f["hi"],
                           "dash": True, "forecast": True, "color": "#888"})
            title += f": {f['verdict'].removeprefix(name + ': ')}"
        charts.append({"kind": "line", "title": title, "series": series, "markers": markers})
    return charts


def rank_charts(view: dict) -> list[dict]:
    return [{"kind": "line", "title": f"{metric} per rank",
             "series": [{"name": f"rank {r}", "x": s["steps"], "y": s["mean"]} for r, s in ranks.items()]}
            for metric, ranks in view["per_rank"].items()]


def consistency_table(c: dict | None) -> str:
    if c is None:
        return '<p class="note">No evaluation with per-rank results is stored for this run.</p>'
    esc = html.escape
    head = "".join(f"<th>{esc(m)}</th>" for m in c["metrics"])
    overall = "".join(f"<td>{_num(o['mean'])} [{_num(o['lo'])}, {_num(o['hi'])}]</td>" for o in c["overall"])
    rows = [f'<tr><th class="l">rank</th>{head}<th class="l">result</th></tr>',
            f'<tr><td class="l">all (95% CI)</td>{overall}<td class="l"></td></tr>']
    for r in c["ranks"]:
        cells = "".join(f'<td class="{"bad" if x["differs"] else ""}" title="{esc(x["message"])}">{_num(x["mean"])}'
                        f' <span class="note">n={x["n"]}</span></td>' for x in r["cells"])
        differs = [x["metric"] for x in r["cells"] if x["differs"]]
        verdict = (f'<span class="bad">differs: {esc(", ".join(differs))}</span>' if differs
                   else '<span class="ok">consistent</span>')
        rows.append(f'<tr><td class="l">rank {r["rank"]}</td>{cells}<td class="l">{verdict}</td></tr>')
    return (f'<p class="note">Evaluation {esc(c["eval_id"])} at step {c["step"]}: each rank\'s mean beside the '
            "run's. A rank is marked when the workers' consistency test (chi-square / Kruskal–Wallis, Holm) "
            f'named it.</p><table id="consistency">{"".join(rows)}</table>')


def _num(x) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.4g}"


def forecast_list(forecasts: dict | None) -> str:
    from rankwatch.sinks.report_forecast import verdicts

    lines = verdicts(forecasts) if forecasts else []
    if not lines:
        return '<p class="note">Nothing to forecast: no eval metric and no rule-watched metric with enough points.</p>'
    items = "".join(f'<li class="{"bad" if "risk" in v else ""}">{html.escape(v)}</li>' for v in lines)
    return f'<ul id="forecasts">{items}</ul>'


def run_sections(view: dict, forecasts: dict | None = None) -> list[Section]:
    """``forecasts``: ``report_forecast.run_forecasts``'s {"eval": …, "training": …}."""
    forecasts = forecasts or {"eval": {}, "training": {}}
    alerts = view["alerts"]
    steps = [s for c in view["curves"].values() for s in c["steps"]]
    span = [min(steps), max(steps)] if steps else []
    hm = view["heatmap"]
    return [
        Section("Look ahead", "Each eval metric, and each training metric a rule watches, fitted with a saturating "
                "trend and a 95% prediction band (dashed in the charts).", body=forecast_list(forecasts)),
        Section("Eval metrics over steps", "Mean at each evaluation with its 95% confidence band; dashed: the fitted "
                "trend and its 95% prediction band.", eval_charts(view, forecasts["eval"]),
                "" if view["eval"] else '<p class="note">No eval reports stored.</p>'),
        Section("Training curves", "Run-wide mean and p95 per rollup window; dashed red lines mark alerts on the "
                "metric (hover for the message); dashed grey: the forecast of a rule-watched metric.",
                curve_charts(view, forecasts["training"])),
        Section("Throughput and step time per rank", "Window means, one line per rank.", rank_charts(view),
                "" if view["per_rank"] else '<p class="note">No step-time or throughput metric logged.</p>'),
        Section("Rank × step heatmap", "Each cell: the rank's window mean relative to that window's median across "
                "ranks (red slower/higher, blue lower). A straggler is a red row.",
                [{"kind": "heat", "title": f"{hm['metric']}: rank × step", **hm}] if hm else []),
        Section("Alert timeline", "One row per alert condition, from the step it started firing to the step it "
                "resolved (to the end of the run while still firing).",
                [{"kind": "timeline", "title": f"{len(alerts)} alert transitions", "alerts": alerts, "span": span}]
                if alerts else [], "" if alerts else '<p class="note">No alerts for this run.</p>'),
        Section("Eval consistency per rank", body=consistency_table(view["consistency"])),
    ]


def render_run(q: Queries, run: str, *, heatmap_metric: str | None = None, forecasts: dict | None = None) -> str:
    view = run_view(q, run, heatmap_metric=heatmap_metric)
    n_evals = len(next(iter(view["eval"].values()), {"steps": []})["steps"])
    intro = (f'<p class="note">Run <b>{html.escape(run)}</b>: {n_evals} evaluations, {len(view["curves"])} metrics, '
             f'{len(view["alerts"])} alert transitions. From the report store, '
             f'{time.strftime("%Y-%m-%d %H:%M:%S %Z")}.</p>')
    return page(f"rankwatch report: {run}", intro, run_sections(view, forecasts))
