"""Scenario suite: real small torch training runs with injected faults, scored end to end.

Each scenario is recorded as a few runs (seeds) of several ranks (processes, gloo) whose real
``TrainerHook`` and ``RankPublisher`` write what they would publish (``scenario_runs``); then the
telemetry is replayed through rankwatch's pure pipeline, stage 1 and stage 2 exactly as the worker
calls them, on the recording's own clock (``scenario_replay``). No broker: its latency is measured
by ``bench/nan_latency.py``. Each step also waits 15 ms on a simulated accelerator (a sleep, see
``scenario_runs``), so step times carry the host's scheduling noise but four ranks on two cores do
not fight over the CPU for the whole step; other jobs on the host still show in the step-time
scenarios.

Rules sets: the shipped defaults, the bench's proposal (``scenario_rules``, with its reasons) and
any ``--rules`` file. The proposal was chosen on seeds 0-2; ``--first-seed 3`` scores fresh runs.
A last table (``scenario_study``, offline) compares cross-rank straggler signals and decisions
that the rules cannot express yet.

Scoring, per run:

- the fault's window is ``[onset, end + SETTLE)`` in steps (``end`` = the last faulty step; a fault
  that lasts, such as a dead rank or a changed reward, runs to the end of the run); for a stall it
  starts one step earlier, since a hung rank's last step is the one before it hung;
- detected: a firing alert of the scenario's condition family (detector and metric) whose step is
  within ``DETECT`` steps of a one-step fault, or while a longer fault lasts (an alert when a
  straggler recovers is no detection); for a hung or exiting rank (goals in seconds), a stall
  alert sent after the fault's injection (a rank that dies takes its unsent last steps with it); delay = that alert's step minus the onset, latency = the
  wall time from the fault's injection on the rank to the alert leaving stage 2;
- names rank: for a fault on one rank, that alert lists the rank (and not every rank);
- false alerts: firing alerts (each incident once, however many times grouping re-sends it) of
  any condition whose step is outside the window; clean rank-steps are ranks x steps outside fault
  windows, clean runs included; FA/10k = false alerts per 10,000 clean rank-steps. Stall alerts
  raised after a run ended (its ranks stopped for good) are counted apart, in "run-end".

    python bench/scenarios.py                       # all scenarios, 3 seeds: about 6 minutes on 2 cores
    python bench/scenarios.py --only nan spike --seeds 2
    python bench/scenarios.py --recordings /tmp/rec # keep the recordings; a second call only replays
    python bench/scenarios.py --rules my.toml       # also score another rules file
    python bench/scenarios.py --first-seed 3        # other seeds (held out from choosing the proposal)

Prints one table per rules set and writes ``bench/results/scenarios.json``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scenario_replay import Emitted, replay  # noqa: E402
from scenario_rules import proposed_rules  # noqa: E402
from scenario_runs import Fault, RunSpec, load_meta, load_spec, read_batches, record  # noqa: E402
from scenario_study import study  # noqa: E402

from rankwatch.stream_processors.rules import Rules, default_rules  # noqa: E402

SETTLE = 50  # steps after a fault ends that still belong to it (recovery, resolves)
DETECT = 10  # steps after a one-step fault within which an alert counts as detecting it


@dataclass(frozen=True)
class Scenario:
    name: str
    task: str = "sup"
    ddp: bool = True
    fault: str | None = None
    duration: int = 1  # faulty steps; 0: to the end of the run
    family: tuple[str, ...] = ()  # metric globs of the alerts that detect it
    detectors: tuple[str, ...] = ()  # detectors whose alerts detect it (empty: any)
    one_rank: bool = True  # the fault hits one rank (so an alert should name it)
    goal: str = ""  # which goal the delay is held to
    about: str = ""


SCENARIOS = {s.name: s for s in (
    Scenario("clean_ddp", about="supervised MLP, 4-rank DDP (gloo), no fault"),
    Scenario("clean_indep", ddp=False, about="the same, ranks train alone (no all-reduce)"),
    Scenario("clean_rl", task="rl", about="REINFORCE on a contextual bandit, DDP, no fault"),
    Scenario("nan", fault="nan", family=("*",), detectors=("nonfinite",), goal="steps",
             about="one rank's batch holds a NaN (the all-reduce spreads it; the step is skipped)"),
    Scenario("spike", fault="spike", family=("loss", "grad_norm"), detectors=("spike", "blowup"), goal="steps",
             about="one rank gets one corrupted batch (inputs x20, random labels)"),
    Scenario("lr100", fault="lr100", duration=30, one_rank=False,
             family=("loss", "grad_norm", "update_ratio", "param_norm"),
             about="learning rate x100 on every rank for 30 steps (gradient explosion)"),
    Scenario("straggler_ddp", fault="straggler", duration=50, goal="steps",
             family=("compute_time_s", "step_time_s", "collective_time_s", "data_wait_s", "samples_per_s"),
             about="one rank's step takes 10 ms more for 50 steps (~30 ms steps), DDP: every rank waits for it"),
    Scenario("straggler_indep", ddp=False, fault="straggler", duration=50, goal="steps",
             family=("compute_time_s", "step_time_s", "data_wait_s", "samples_per_s"),
             about="the same, ranks not synchronised (~20 ms steps): only the straggler slows"),
    Scenario("hang", fault="hang", family=("steps",), detectors=("stall",), goal="seconds",
             about="one rank's training thread hangs 12 s (heartbeats go on); DDP peers wait in the all-reduce"),
    Scenario("exit", fault="exit", duration=0, family=("steps",), detectors=("stall",), goal="seconds",
             about="one rank dies (os._exit); peers hang in the all-reduce 12 s, then the launcher kills them"),
    Scenario("eval_collapse", fault="label_perm", duration=0, one_rank=False, family=("eval_*",),
             about="a data bug permutes every training label: held-out eval_accuracy collapses"),
    Scenario("reward_collapse", task="rl", fault="env_shift", duration=0, one_rank=False, family=("*reward*",),
             about="the bandit's reward is flipped (1 - payoff) under the policy: reward collapses"),
)}


def plan(names: list[str], seeds: range, ranks: int, steps: int, root: Path, hang_s: float) -> list[RunSpec]:
    specs = []
    for name in names:
        sc = SCENARIOS[name]
        for seed in seeds:
            rng = np.random.default_rng([seed, len(name)])
            fault = None
            if sc.fault:
                # Late enough for the slowest detector's warm-up (collapse: 109 points).
                onset = int(rng.integers(int(steps * 0.55), int(steps * 0.7)))
                duration = sc.duration or steps - onset
                fault = Fault(sc.fault, onset, duration, int(rng.integers(ranks)) if sc.one_rank else 0)
            specs.append(RunSpec(
                run=f"{name}-s{seed}", task=sc.task, ddp=sc.ddp, seed=seed, ranks=ranks, steps=steps,
                fault=fault, out=str(root / f"{name}-s{seed}"), hang_s=hang_s,
            ))
    return specs


def ensure_recorded(spec: RunSpec) -> float:
    """Record ``spec`` unless the same spec is already recorded there; the seconds it took."""
    path = Path(spec.out)
    if path.joinpath("spec.json").exists() and load_spec(path) == spec:
        return 0.0
    for stale in path.glob("*"):
        stale.unlink()
    started = time.perf_counter()
    record(spec)
    return time.perf_counter() - started


# --- scoring ------------------------------------------------------------------------------------


def _matches(alert, sc: Scenario) -> bool:
    # A page of several conditions (grouping) lists every metric; its detector is its first one's.
    metrics = (alert.metric, *alert.metrics)
    return (not sc.detectors or alert.detector in sc.detectors or len(metrics) > 1) and any(
        fnmatch.fnmatchcase(m, p) for m in metrics for p in sc.family
    )


def fault_window(spec: RunSpec) -> tuple[int, int, int] | None:
    """The fault's steps ``[lo, hi)`` and the end of the steps where an alert counts as detecting it."""
    f = spec.fault
    if f is None:
        return None
    lo = f.onset - (1 if f.kind in ("hang", "exit") else 0)
    hi = spec.steps if f.duration >= spec.steps - f.onset else f.onset + f.duration + SETTLE
    # A fault of several steps must be caught while it lasts (not by its end's recovery).
    return lo, hi, f.onset + (DETECT if f.duration == 1 else f.duration)


def score_run(spec: RunSpec, sc: Scenario, emitted: list[Emitted], last_step: int) -> dict:
    """One run's detection, delay, attribution and false alerts (see the module docstring)."""
    f = spec.fault
    lo, hi, detect_hi = fault_window(spec) or (None, None, None)
    meta = load_meta(Path(spec.out), spec.ranks)
    injected = min((m["inject"]["ts"] for m in meta if "inject" in m), default=None)
    seen, firing = set(), []
    for e in emitted:
        a = e.alert
        if a.status == "firing" and (a.key, a.incident) not in seen:
            seen.add((a.key, a.incident))
            firing.append(e)
    hits, false, run_end, other = [], [], [], []
    for e in firing:
        a = e.alert
        inside = lo is not None and lo <= a.step < hi
        if sc.goal == "seconds" and injected is not None and _matches(a, sc):
            inside = e.at >= injected  # a stall is timed, not stepped: a dead rank's last steps die with it
        if inside:
            (hits if _matches(a, sc) else other).append(e)
        elif a.detector == "stall" and a.step >= last_step - 1:
            run_end.append(e)  # the run ended; a stall alert then means the end was not announced
        else:
            false.append(e)
    detections = [e for e in hits if e.alert.step < detect_hi]
    # Alerts that go out together (a publisher's batch of steps arrives at once) are one moment: the
    # delay is the earliest step any of them names, not whichever happened to be listed first.
    first = min(detections, key=lambda e: (e.at, e.alert.step)) if detections else None
    window = 0 if lo is None else max(0, min(hi, spec.steps) - max(lo, 0))
    out = {
        "run": spec.run, "seed": spec.seed, "fault": asdict(f) if f else None,
        "detected": first is not None if f else None,
        "delay_steps": first.alert.step - f.onset if first else None,
        "latency_s": round(first.at - injected, 3) if first and injected else None,
        "first_alert": _brief(first) if first else None,
        "names_rank": None, "false_alerts": [_brief(e) for e in false],
        "run_end_alerts": [_brief(e) for e in run_end], "other_in_window": [_brief(e) for e in other],
        "clean_rank_steps": spec.ranks * (spec.steps - window),
        "wire_errors": sorted({e.wire_error for e in emitted if e.wire_error}),
    }
    if f is not None and sc.one_rank:
        out["names_rank"] = any(f.rank in e.alert.ranks and len(e.alert.ranks) < spec.ranks for e in detections)
    return out


def _brief(e: Emitted) -> dict:
    a = e.alert
    return {"detector": a.detector, "metric": a.metric, "ranks": list(a.ranks), "step": a.step,
            "incident": a.incident, "value": a.value if np.isfinite(a.value) else str(a.value), "at": round(e.at, 3)}


def summarise(sc: Scenario, runs: list[dict]) -> dict:
    faulty = [r for r in runs if r["fault"]]
    delays = [r["delay_steps"] for r in faulty if r["detected"]]
    latencies = [r["latency_s"] for r in faulty if r["latency_s"] is not None]
    named = [r["names_rank"] for r in faulty if r["names_rank"] is not None]
    false = sum(len(r["false_alerts"]) for r in runs)
    clean = sum(r["clean_rank_steps"] for r in runs)
    return {
        "scenario": sc.name, "about": sc.about, "runs": len(runs),
        "detected": sum(bool(r["detected"]) for r in faulty) if faulty else None,
        "faulty_runs": len(faulty),
        "delay_median": statistics.median(delays) if delays else None, "delay_max": max(delays) if delays else None,
        "latency_median_s": round(statistics.median(latencies), 2) if latencies else None,
        "names_rank": sum(named) if named else None, "named_of": len(named),
        "false_alerts": false, "run_end_alerts": sum(len(r["run_end_alerts"]) for r in runs),
        "clean_rank_steps": clean, "fa_per_10k": 1e4 * false / clean if clean else None,
        "first_alerts": sorted({f"{r['first_alert']['detector']}/{r['first_alert']['metric']}"
                                for r in faulty if r["first_alert"]}),
        "false_by_condition": _count(f"{a['detector']}/{a['metric']}" for r in runs for a in r["false_alerts"]),
        "goal": sc.goal,
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def table(rows: list[dict], title: str) -> str:
    head = ("scenario", "runs", "detected", "delay steps med/max", "latency s", "names rank",
            "false", "FA/10k", "run-end", "first alert (family)")
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        det = "-" if r["detected"] is None else f"{r['detected']}/{r['faulty_runs']}"
        delay = "-" if r["delay_median"] is None or r["goal"] == "seconds" else f"{r['delay_median']:g} / {r['delay_max']}"
        named = "-" if r["names_rank"] is None else f"{r['names_rank']}/{r['named_of']}"
        lines.append("| " + " | ".join([
            r["scenario"], str(r["runs"]), det, delay,
            "-" if r["latency_median_s"] is None else f"{r['latency_median_s']:.2f}", named,
            str(r["false_alerts"]), f"{r['fa_per_10k']:.1f}", str(r["run_end_alerts"]),
            ", ".join(r["first_alerts"]) or "-",
        ]) + " |")
    return "\n".join(lines)


def overall(rows: list[dict]) -> dict:
    faulty = [r for r in rows if r["faulty_runs"]]
    detected = sum(r["detected"] for r in faulty)
    total = sum(r["faulty_runs"] for r in faulty)
    false = sum(r["false_alerts"] for r in rows)
    clean = sum(r["clean_rank_steps"] for r in rows)
    step_goal = [r for r in faulty if r["goal"] == "steps"]
    return {
        "recall": detected / total if total else None, "detected": detected, "faulty_runs": total,
        "false_alerts": false, "clean_rank_steps": clean, "fa_per_10k": 1e4 * false / clean if clean else None,
        "run_end_alerts": sum(r["run_end_alerts"] for r in rows),
        "fa_per_10k_with_run_end": 1e4 * (false + sum(r["run_end_alerts"] for r in rows)) / clean if clean else None,
        "delay_goal_met": {r["scenario"]: r["delay_max"] is not None and r["delay_max"] <= 3
                           and r["detected"] == r["faulty_runs"] for r in step_goal},
    }


def wire_note(runs: dict[str, list[dict]]) -> str:
    bad = [(name, r["run"], e) for name, rs in runs.items() for r in rs for e in r["wire_errors"]]
    if not bad:
        return ""
    reasons = sorted({e for _, _, e in bad})
    return (f"\nalerts a consumer of the alert topic cannot decode: in {len(bad)} runs "
            f"({', '.join(sorted({n for n, _, _ in bad}))}): {'; '.join(reasons)}")


def verdict(o: dict) -> str:
    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return "\n".join([
        f"recall {o['detected']}/{o['faulty_runs']} = {o['recall']:.2f} (goal >= 0.95: {mark(o['recall'] >= 0.95)})",
        f"false alerts {o['false_alerts']} in {o['clean_rank_steps']} clean rank-steps = {o['fa_per_10k']:.1f} "
        f"per 10k (goal <= 1: {mark(o['fa_per_10k'] <= 1)}); with {o['run_end_alerts']} run-end stall alerts: "
        f"{o['fa_per_10k_with_run_end']:.1f}",
        "delay <= 3 steps on every run: " + ", ".join(f"{k} {mark(v)}" for k, v in o["delay_goal_met"].items()),
    ])


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="scenarios to run (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from here (default 0)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per run (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--hang-s", type=float, default=12.0,
                        help="how long a hung rank (and the peers of a dead one) stays silent (default 12)")
    parser.add_argument("--recordings", type=Path, help="keep recordings here and reuse matching ones")
    parser.add_argument("--rules", type=Path, action="append", default=[], help="also score this rules file")
    parser.add_argument("--no-proposed", action="store_true", help="skip the bench's proposed rules")
    parser.add_argument("--no-study", action="store_true", help="skip the offline straggler-signal study")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scenarios.json", help="JSON results file")
    args = parser.parse_args(argv)

    names = args.only or list(SCENARIOS)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rankwatch-scenarios-") as tmp:
        root = args.recordings or Path(tmp)
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        specs = plan(names, seeds, args.ranks, args.steps, root, args.hang_s)
        record_s = 0.0
        for i, spec in enumerate(specs, 1):
            took = ensure_recorded(spec)
            record_s += took
            print(f"[{i}/{len(specs)}] {spec.run}: " + (f"recorded in {took:.1f} s" if took else "reused"),
                  file=sys.stderr, flush=True)
        variants: dict[str, Rules] = {"default": default_rules()}
        if not args.no_proposed:
            variants["proposed"] = proposed_rules()
        variants.update({p.stem: Rules.load(p) for p in args.rules})
        report = {"python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
                  "scenarios": {n: asdict(SCENARIOS[n]) for n in names}, "rules": {}}
        outputs = []
        replay_started = time.perf_counter()
        loaded = {spec.run: _load(spec) for spec in specs}
        for label, rules in variants.items():
            per_scenario = []
            runs_out = {}
            for name in names:
                runs = []
                for spec in (s for s in specs if s.run.rsplit("-s", 1)[0] == name):
                    batches, last_step = loaded[spec.run]
                    runs.append(score_run(spec, SCENARIOS[name], replay(batches, rules, spec.run), last_step))
                runs_out[name] = runs
                per_scenario.append(summarise(SCENARIOS[name], runs))
            o = overall(per_scenario)
            report["rules"][label] = {"summary": per_scenario, "overall": o, "runs": runs_out}
            outputs.append(table(per_scenario, f"rules: {label}") + "\n\n" + verdict(o) + wire_note(runs_out))
        replay_s = time.perf_counter() - replay_started
        if not args.no_study:
            windows = [(spec, loaded[spec.run][0], (fault_window(spec) or (None, None))[:2]) for spec in specs]
            study_table = study([(spec, b, None if w[0] is None else w) for spec, b, w in windows])
            report["straggler_study"] = study_table
            outputs.append("## offline: cross-rank straggler signals (see bench/scenario_study.py)\n\n" + study_table)
    timing = (f"{len(specs)} runs x {args.ranks} ranks x {args.steps} steps; recording {record_s:.0f} s, "
              f"replay {replay_s:.0f} s ({len(variants)} rules sets), total {time.perf_counter() - started:.0f} s")
    report["timing"] = timing
    print("\n\n".join(outputs))
    print("\n" + timing)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def _load(spec: RunSpec) -> tuple[list, int]:
    batches = [b for r in range(spec.ranks) for b in read_batches(Path(spec.out) / f"rank{r}.bin")]
    last = max((int(s.steps.max()) for b in batches for s in b.series.values() if len(s.steps)), default=-1)
    return batches, last


if __name__ == "__main__":
    raise SystemExit(main())
