"""Settings: built from an explicit env mapping, overrides win, validation raises ValueError."""

from __future__ import annotations

import dataclasses

import pytest

from rankwatch.settings import DEFAULT_BOOTSTRAP, FLAVORS, Settings

FULL_ENV = {
    "RANKWATCH_BOOTSTRAP": "broker:29092",
    "RANKWATCH_BROKER_FLAVOR": "tansu",
    "RANKWATCH_PARTITIONS": "16",
    "RANKWATCH_APP_ID": "rw-test",
    "RANKWATCH_ROLLUP_STEPS": "25",
    "RANKWATCH_DATA_DIR": "/tmp/rw",
}


def test_empty_env_gives_the_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.bootstrap, s.broker_flavor, s.partitions, s.app_id, s.rollup_steps, s.data_dir) == (
        DEFAULT_BOOTSTRAP, "auto", 8, "rankwatch", 50, ".rankwatch",
    )


def test_every_variable_is_read_and_ints_are_parsed():
    s = Settings.from_env(FULL_ENV)
    assert s == Settings(
        bootstrap="broker:29092", broker_flavor="tansu", partitions=16, app_id="rw-test",
        rollup_steps=25, data_dir="/tmp/rw",
    )
    assert isinstance(s.partitions, int) and isinstance(s.rollup_steps, int)


def test_unrelated_variables_are_ignored():
    s = Settings.from_env({"BOOTSTRAP": "x:1", "RANKWATCH_UNKNOWN": "y", "rankwatch_bootstrap": "z:2"})
    assert s == Settings()


def test_overrides_win_over_env():
    s = Settings.from_env(FULL_ENV, bootstrap="cli:9999", partitions=3, rollup_steps="7")
    assert (s.bootstrap, s.partitions, s.rollup_steps) == ("cli:9999", 3, 7)
    assert (s.broker_flavor, s.app_id, s.data_dir) == ("tansu", "rw-test", "/tmp/rw")


def test_none_overrides_do_not_mask_env():
    s = Settings.from_env(FULL_ENV, bootstrap=None, partitions=None)
    assert (s.bootstrap, s.partitions) == ("broker:29092", 16)


def test_from_env_does_not_read_the_process_environment_when_given_a_mapping(monkeypatch):
    monkeypatch.setenv("RANKWATCH_BOOTSTRAP", "from-process:1")
    monkeypatch.setenv("RANKWATCH_PARTITIONS", "99")
    assert Settings.from_env({}) == Settings()


def test_from_env_mapping_is_not_modified():
    env = dict(FULL_ENV)
    Settings.from_env(env, bootstrap="cli:1")
    assert env == FULL_ENV


@pytest.mark.parametrize("flavor", ["kafka2", "", "Tansu", "redpanda"])
def test_invalid_flavor_raises(flavor):
    with pytest.raises(ValueError, match="broker_flavor"):
        Settings.from_env({"RANKWATCH_BROKER_FLAVOR": flavor})
    with pytest.raises(ValueError, match="broker_flavor"):
        Settings.from_env({}, broker_flavor=flavor)
    with pytest.raises(ValueError, match="broker_flavor"):
        Settings(broker_flavor=flavor)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_flavor_is_accepted(flavor):
    assert Settings.from_env({"RANKWATCH_BROKER_FLAVOR": flavor}).broker_flavor == flavor


@pytest.mark.parametrize("var", ["RANKWATCH_PARTITIONS", "RANKWATCH_ROLLUP_STEPS"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_counts_raise(var, value):
    with pytest.raises(ValueError, match=">= 1"):
        Settings.from_env({var: value})


@pytest.mark.parametrize("var", ["RANKWATCH_PARTITIONS", "RANKWATCH_ROLLUP_STEPS"])
def test_non_integer_counts_raise_value_error(var):
    with pytest.raises(ValueError):
        Settings.from_env({var: "eight"})


def test_state_is_written_before_it_could_expire():
    assert Settings.from_env({"RANKWATCH_STATE_WRITE_S": "2"}).state_write_s == 2.0
    with pytest.raises(ValueError, match="state_write_s must be > 0"):
        Settings.from_env({"RANKWATCH_STATE_WRITE_S": "0"})
    with pytest.raises(ValueError, match="longer than state_write_s"):
        Settings.from_env({"RANKWATCH_STATE_TTL_S": "10", "RANKWATCH_STATE_WRITE_S": "15"})
    assert Settings(state_ttl_s=0, state_write_s=60).state_ttl_s == 0  # kept for good: nothing expires


def test_settings_are_frozen_and_keyword_only():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.partitions = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Settings("127.0.0.1:9092")  # type: ignore[misc]


def test_with_returns_a_changed_copy_and_validates():
    s = Settings()
    t = s.with_(partitions=2)
    assert t.partitions == 2 and s.partitions == 8
    assert t.with_(partitions=8) == s
    with pytest.raises(ValueError):
        s.with_(broker_flavor="nope")
