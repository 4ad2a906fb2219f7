"""Rules the scenario bench proposes as defaults, scored beside ``rules.default.toml``.

This proposal has been adopted as ``stream_processors/rules.default.toml``; edit ``PROPOSED`` to
score the next candidate against the defaults.

Each change from the defaults is there for a number the bench printed (see the final report of
the bench's author; chosen on seeds 0-2, so check them on others with ``--first-seed``):

- throughput (``samples_per_s``, ``tokens_per_s``): only a drop is a fault. The defaults' two-sided
  spike fires when a quick step follows a slow one on a busy host (10 of 95 false alerts in an
  early, noisier recording, every one of them upward).
- ``data_wait_s`` across ranks: a floor of 2 ms on the unit (``min_scale``). A wait of a fraction of
  a millisecond makes ``min_rel`` a few microseconds, so one scheduler hiccup on one rank fired
  (all 21 of the defaults' false alerts on seeds 0-2, all 20 on seeds 3-5); a loader that holds a
  rank back 15 ms or more beyond its peers still fires.
- ``collective_time_s`` across ranks, downwards: in DDP every rank's step time is the same (they
  wait for each other in the all-reduce), so ``step_time_s`` cannot name a straggler; the
  straggler is the rank that waits least.
- cross-rank threshold 0.9 (|z| > 4.9 rather than 7.7) with ``for = 2`` on step and collective
  time: no false alert in the clean rank-steps, more stragglers caught.
- ``collapse`` on evaluation metrics (``eval_*``, ``*accuracy*``), with windows sized for a metric
  logged every few steps (the reward rule's 100-point reference takes 500 steps to fill there).
"""

from __future__ import annotations

from stream_processors.rules import DEFAULT_RULES_PATH, Rules

PROPOSED = DEFAULT_RULES_PATH.read_text()


def proposed_rules() -> Rules:
    return Rules.from_toml(PROPOSED, "bench proposed rules")
