"""Alert rules files: defaults, globs, strict validation."""

from __future__ import annotations

import pytest

from rankwatch.stream_processors.rules import Rules, RulesError, default_rules


def test_defaults_watch_every_metric_for_nan_and_skip_spikes_on_flags():
    rules = default_rules()
    assert set(rules.for_metric("loss")) == {"nonfinite", "spike", "explode"}
    assert set(rules.for_metric("ppo_actor/update/grad_norm")) == {"nonfinite", "spike", "blowup", "explode"}
    assert set(rules.for_metric("step_time_s")) == {"nonfinite"}  # one slow step is not a fault
    assert rules.cross_rank_rule("compute_time_s").params["direction"] == "up"
    assert rules.stall is not None and rules.cross_rank_rule("lr") is None
    assert set(rules.for_metric("grad_nonfinite")) == {"nonfinite"}
    assert rules.for_metric("loss")["nonfinite"].severity == "critical"


def test_globs_first_rule_per_detector_wins_and_params_reach_the_detector():
    rules = Rules.from_toml(
        """
        [[rule]]
        metrics = ["ppo_actor/*/grad_norm"]
        detector = "spike"
        params = { window = 16, warmup = 8 }
        for = 2

        [[rule]]
        metrics = ["*"]
        detector = "spike"
        """
    )
    chosen = rules.for_metric("ppo_actor/update/grad_norm")["spike"]
    assert chosen.for_ == 2 and chosen.build().window == 16
    assert rules.for_metric("loss")["spike"].params == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[rule]]\nmetrics=['x']\ndetector='nope'", "detector must be one of"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\ncolour='red'", "unknown key(s) ['colour']"),
        ("[[rule]]\nmetrics=[]\ndetector='spike'", "non-empty list"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nseverity='panic'", "severity must be one of"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nparams={window=1}", "bad params for spike"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nfor=0", "for >= 1"),
        ("[[rules]]\nmetrics=['x']", "unknown section"),
        ("[[rule]\n", "not valid TOML"),
        ("[grouping]\ngroup_interval_s = -1", "group_wait_s and group_interval_s must be >= 0"),
        ("[grouping]\ngroup_intervall_s = 5", "unknown key(s) ['group_intervall_s'] in [grouping]"),
        ("[grouping]\ninhibit = 'yes'", "inhibit must be true or false"),
        ("[grouping]\ngroup_wait_s = 'soon'", "[grouping]: group_wait_s must be a number of seconds, got 'soon'"),
        ("[grouping]\ngroup_interval_s = nan", "group_interval_s must be a number of seconds, got nan"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nfor='2'", "rule 1: for must be a whole number, got '2'"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\ncooldown=2.5", "cooldown must be a whole number, got 2.5"),
        ("[[rule]]\nmetrics='loss'\ndetector='spike'", "metrics must be a non-empty list"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nexclude='lr'", "exclude must be a list of glob patterns"),
        ("[[rule]]\nmetrics=['x']\ndetector='spike'\nparams='window=8'", "params must be a table"),
    ],
)
def test_bad_rules_fail_with_a_message_naming_the_problem(text, message):
    with pytest.raises(RulesError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        Rules.from_toml(text, "rules.toml")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(RulesError, match="cannot read rules file"):
        Rules.load(tmp_path / "absent.toml")


def test_the_test_rules_are_the_defaults_with_a_longer_group_wait():
    from conftest import TEST_RULES

    test = Rules.load(TEST_RULES)
    assert test.rules == default_rules().rules and test.group_wait_s == 2.0
    assert test.group_interval_s == default_rules().group_interval_s == 2.0 and test.inhibit and default_rules().inhibit
