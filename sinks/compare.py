"""``rankwatch report --compare R1 R2 …``: runs side by side, with a significance test between them.

For each eval metric: every run's final and best evaluation, and Welch's t-test (from the reports' mean,
std and n) of each run's final value against the leading run's, Holm-adjusted over the runs compared. The
runs are ranked by the final composite score (``RANKWATCH_EVAL_COMPOSITE``) when their reports carry one,
else by the first eval metric, and the page says which it used.
"""

from __future__ import annotations

import html
import math

from scipy import stats

from rankwatch.sinks.html_report import Section, clean, page
from rankwatch.sinks.report_data import curves, final_reports
from rankwatch.sinks.store_query import Queries

ALPHA = 0.05
#: Names whose smaller values are better; every other eval metric is better when larger.
LOWER_IS_BETTER = ("loss", "error", "err", "perplexity", "ppl", "length", "time", "nonfinite", "latency")


def lower_is_better(metric: str) -> bool:
    """>>> lower_is_better("eval_loss"), lower_is_better("correct")
    (True, False)
    """
    return any(word in metric.lower() for word in LOWER_IS_BETTER)


def holm(p: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the given order.

    >>> [round(x, 3) for x in holm([0.01, 0.04, 0.03])]
    [0.03, 0.06, 0.06]
    """
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [1.0] * len(p), 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - k) * p[i]))
        out[i] = running
    return out


def run_summary(reports) -> dict:
    """Per eval metric: the final evaluation and the best one (by the metric's direction); the composite."""
    done = final_reports(reports)
    out: dict = {"evaluations": len(done), "metrics": {}, "composite": None, "steps": [r.step for r in done]}
    for r in done:
        for name, m in r.metrics.items():
            entry = {"step": r.step, "mean": m["mean"], "std": m.get("std", math.nan), "n": m.get("n", 0),
                     "ci_low": m.get("ci_low", math.nan), "ci_high": m.get("ci_high", math.nan)}
            s = out["metrics"].setdefault(name, {"final": entry, "best": entry})
            s["final"] = entry
            sign = -1.0 if lower_is_better(name) else 1.0
            if math.isfinite(m["mean"]) and not sign * m["mean"] <= sign * s["best"]["mean"]:
                s["best"] = entry
    if done and done[-1].composite is not None:
        out["composite"] = {"step": done[-1].step, "value": done[-1].composite}
    return out


def compare(q: Queries, runs: list[str]) -> dict:
    """Everything ``--compare`` prints, as JSON-able dicts."""
    summaries = {run: run_summary(q.eval_reports(run)) for run in runs}
    metrics = sorted({m for s in summaries.values() for m in s["metrics"]})
    tests = {}
    for name in metrics:
        have = [r for r in runs if name in summaries[r]["metrics"]]
        sign = -1.0 if lower_is_better(name) else 1.0
        leader = max(have, key=lambda r: sign * _finite(summaries[r]["metrics"][name]["final"]["mean"], sign))
        a = summaries[leader]["metrics"][name]["final"]
        others = [r for r in have if r != leader]
        raw = []
        for r in others:
            b = summaries[r]["metrics"][name]["final"]
            raw.append(_welch(a, b))
        adjusted = holm(raw) if raw else []
        tests[name] = {"leader": leader, "direction": "lower" if sign < 0 else "higher",
                       "vs": [{"run": r, "diff": a["mean"] - summaries[r]["metrics"][name]["final"]["mean"],
                               "p": p, "p_holm": ph, "significant": ph < ALPHA}
                              for r, p, ph in zip(others, raw, adjusted)]}
    with_composite = [r for r in runs if summaries[r]["composite"] is not None]
    if with_composite and len(with_composite) == len(runs):
        by, ranking = "composite", sorted(runs, key=lambda r: -summaries[r]["composite"]["value"])
    elif metrics:
        by = metrics[0]
        sign = -1.0 if lower_is_better(by) else 1.0
        ranking = sorted([r for r in runs if by in summaries[r]["metrics"]],
                         key=lambda r: -sign * _finite(summaries[r]["metrics"][by]["final"]["mean"], sign))
    else:
        by, ranking = None, []
    verdict = _verdict(by, ranking, tests, summaries)
    return {"runs": runs, "summaries": summaries, "tests": tests, "ranked_by": by, "ranking": ranking,
            "verdict": verdict}


def _welch(a: dict, b: dict) -> float:
    """Two-sided p of Welch's t-test from summaries; 1.0 when either side cannot be tested."""
    if min(a["n"], b["n"]) < 2 or not all(map(math.isfinite, (a["mean"], b["mean"], a["std"], b["std"]))):
        return 1.0
    if a["std"] == 0 and b["std"] == 0:
        return 1.0 if a["mean"] == b["mean"] else 0.0
    return float(stats.ttest_ind_from_stats(a["mean"], a["std"], a["n"], b["mean"], b["std"], b["n"],
                                            equal_var=False).pvalue)


def _finite(x: float, sign: float) -> float:
    return x if math.isfinite(x) else -math.inf * sign


def _verdict(by: str | None, ranking: list[str], tests: dict, summaries: dict) -> str:
    if not ranking:
        return "no eval reports to compare"
    best = ranking[0]
    if by == "composite":
        scores = ", ".join(f"{r} {summaries[r]['composite']['value']:.4g}" for r in ranking)
        text = f"{best} did best on the composite score ({scores})"
    else:
        text = f"{best} did best on {by} (no composite score configured)"
    # The significance of the lead, on the metric the ranking used (or the first one, for a composite).
    metric = by if by in tests else next(iter(tests), None)
    t = tests.get(metric, {"leader": None, "vs": []})
    if t["leader"] != best:
        return text + (f"; on {metric} {t['leader']} leads" if metric else "")
    beaten = [v["run"] for v in t["vs"] if v["significant"]]
    tied = [v["run"] for v in t["vs"] if not v["significant"]]
    if beaten:
        text += f"; on {metric} significantly better than {', '.join(beaten)}"
    if tied:
        text += f"; on {metric} not distinguishable from {', '.join(tied)} (Holm p >= {ALPHA})"
    return text


def format_text(result: dict) -> str:
    lines = [f"runs ranked by {result['ranked_by']}: {' > '.join(result['ranking'])}", result["verdict"], ""]
    for name, t in result["tests"].items():
        lines.append(f"{name} ({t['direction']} is better; leader {t['leader']})")
        for run in result["runs"]:
            m = result["summaries"][run]["metrics"].get(name)
            if m is None:
                continue
            f, b = m["final"], m["best"]
            vs = next((v for v in t["vs"] if v["run"] == run), None)
            test = f"  vs leader p={vs['p_holm']:.2g}{' *' if vs['significant'] else ''}" if vs else "  (leader)"
            lines.append(f"  {run:<32} final {f['mean']:.4g} [{f['ci_low']:.4g}, {f['ci_high']:.4g}] @ {f['step']}"
                         f"  best {b['mean']:.4g} @ {b['step']}{test}")
    return "\n".join(lines)


def render_compare(q: Queries, runs: list[str]) -> tuple[str, dict]:
    """The comparison page and the result it shows."""
    result = compare(q, runs)
    evals = {}
    for run in runs:
        for r in final_reports(q.eval_reports(run)):
            for name, m in r.metrics.items():
                s = evals.setdefault(name, {}).setdefault(run, {"x": [], "y": [], "lo": [], "hi": []})
                s["x"].append(r.step)
                s["y"].append(m["mean"])
                s["lo"].append(m.get("ci_low"))
                s["hi"].append(m.get("ci_high"))
    eval_charts = [{"kind": "line", "title": f"eval {name} (95% CI)",
                    "series": [{"name": run, "points": True, **s} for run, s in by_run.items()]}
                   for name, by_run in sorted(evals.items())]
    run_curves = {run: curves(q.rollups(run, _run_wide())) for run in runs}
    shared = sorted(set.intersection(*(set(c) for c in run_curves.values()))) if run_curves else []
    curve_charts = [{"kind": "line", "title": name, "series": [
        {"name": run, "x": run_curves[run][name]["steps"], "y": run_curves[run][name]["mean"]} for run in runs]}
        for name in shared]
    intro = f'<p class="note">{html.escape(result["verdict"])}.</p>'
    sections = [
        Section("Eval metrics, all runs", "Each run's mean at each evaluation with its 95% confidence band.",
                eval_charts),
        Section("Final and best evaluations", body=_table(result)),
        Section("Training curves, all runs", "Run-wide window means, one line per run.", curve_charts),
    ]
    return page(f"rankwatch compare: {' vs '.join(runs)}", intro, sections), clean(result)


def _run_wide():
    from rankwatch.sinks.store_query import Filters

    return Filters(rank="all")


def _table(result: dict) -> str:
    esc = html.escape
    rows = ['<tr><th class="l">metric</th><th class="l">run</th><th>final [95% CI]</th><th>at step</th>'
            '<th>best</th><th>at step</th><th>vs leader (Welch, Holm p)</th></tr>']
    for name, t in result["tests"].items():
        for run in result["runs"]:
            m = result["summaries"][run]["metrics"].get(name)
            if m is None:
                continue
            f, b = m["final"], m["best"]
            vs = next((v for v in t["vs"] if v["run"] == run), None)
            test = ("leader" if vs is None else
                    f'<span class="{"bad" if vs["significant"] else "note"}">{vs["p_holm"]:.2g}'
                    f'{" (worse)" if vs["significant"] else " (tie)"}</span>')
            rows.append(f'<tr><td class="l">{esc(name)}</td><td class="l">{esc(run)}</td>'
                        f'<td>{f["mean"]:.4g} [{f["ci_low"]:.4g}, {f["ci_high"]:.4g}]</td><td>{f["step"]}</td>'
                        f'<td>{b["mean"]:.4g}</td><td>{b["step"]}</td><td>{test}</td></tr>')
    return f'<table id="comparison">{"".join(rows)}</table>'
