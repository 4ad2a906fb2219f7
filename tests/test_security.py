"""KafkaSecurity: read from RANKWATCH_* through Settings, the password masked, one converter per client library."""

from __future__ import annotations

import asyncio
import ssl
import subprocess

import faust
import pytest
from kafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    SaslAuthenticationFailedError,
)

from rankwatch.security import PLAINTEXT, KafkaSecurity, auth_error_line, client_error_line, explain_failure
from rankwatch.settings import Settings

SECRET = "pa55-w0rd-never-shown"
SASL_ENV = {
    "RANKWATCH_SECURITY_PROTOCOL": "SASL_SSL",
    "RANKWATCH_SASL_MECHANISM": "SCRAM-SHA-256",
    "RANKWATCH_SASL_USERNAME": "alice",
    "RANKWATCH_SASL_PASSWORD": SECRET,
    "RANKWATCH_SSL_CAFILE": "/etc/kafka/ca.pem",
    "RANKWATCH_SSL_CHECK_HOSTNAME": "false",
}


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory) -> str:
    """A self-signed CA certificate (with openssl), so TLS contexts can load a real file."""
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "ca.key"),
                    "-out", str(d / "ca.pem"), "-days", "1", "-subj", "/CN=rankwatch unit test CA"],
                   check=True, capture_output=True)
    return str(d / "ca.pem")


def test_the_default_is_plaintext_and_adds_nothing_to_any_client():
    s = Settings.from_env({})
    assert s.security == PLAINTEXT
    assert (s.security.kafka_python(), s.security.aiokafka(), s.security.faust()) == ({}, {}, {})


def test_every_variable_is_read_through_settings():
    sec = Settings.from_env(SASL_ENV).security
    assert sec == KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", username="alice",
                                password=SECRET, ssl_cafile="/etc/kafka/ca.pem", ssl_check_hostname=False)
    assert Settings.from_env({**SASL_ENV, "RANKWATCH_SSL_CERTFILE": "c.pem", "RANKWATCH_SSL_KEYFILE": "k.pem"}
                             ).security.kafka_python()["ssl_keyfile"] == "k.pem"


def test_the_password_can_come_from_a_file(tmp_path):
    secret = tmp_path / "password"
    secret.write_text(SECRET + "\n")
    env = {k: v for k, v in SASL_ENV.items() if k != "RANKWATCH_SASL_PASSWORD"}
    s = Settings.from_env({**env, "RANKWATCH_SASL_PASSWORD_FILE": str(secret)})
    assert s.security.password == SECRET


def test_a_missing_password_file_is_named_without_guessing(tmp_path):
    env = {k: v for k, v in SASL_ENV.items() if k != "RANKWATCH_SASL_PASSWORD"}
    with pytest.raises(ValueError, match="RANKWATCH_SASL_PASSWORD_FILE: cannot read"):
        Settings.from_env({**env, "RANKWATCH_SASL_PASSWORD_FILE": str(tmp_path / "nope")})


def test_child_processes_rebuild_the_same_security_from_to_env():
    s = Settings.from_env(SASL_ENV)
    assert Settings.from_env(s.to_env()).security == s.security


def test_the_password_never_prints(ca_file):
    s = Settings.from_env({**SASL_ENV, "RANKWATCH_SSL_CAFILE": ca_file})
    for text in (repr(s), str(s), repr(s.security), str(s.security), f"{s.security}", repr(s.security.faust())):
        assert SECRET not in text
    assert "password='***'" in repr(s.security)
    assert "password=''" in repr(KafkaSecurity())  # no password: nothing to hide, shown as empty


@pytest.mark.parametrize("env, match", [
    ({"RANKWATCH_SECURITY_PROTOCOL": "TLS"}, "security_protocol"),
    ({**SASL_ENV, "RANKWATCH_SASL_MECHANISM": "GSSAPI"}, "sasl_mechanism"),
    ({**SASL_ENV, "RANKWATCH_SASL_PASSWORD": ""}, "username and password"),
    ({**SASL_ENV, "RANKWATCH_SASL_USERNAME": ""}, "username and password"),
    ({"RANKWATCH_SECURITY_PROTOCOL": "SSL", "RANKWATCH_SSL_KEYFILE": "k.pem"}, "ssl_certfile"),
    ({**SASL_ENV, "RANKWATCH_SSL_CHECK_HOSTNAME": "maybe"}, "not a valid bool"),
])
def test_invalid_settings_raise_at_once(env, match):
    with pytest.raises(ValueError, match=match):
        Settings.from_env(env)


def test_kafka_python_gets_plain_values_it_accepts():
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    kwargs = Settings.from_env(SASL_ENV).security.kafka_python()
    assert kwargs == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
                      "sasl_plain_username": "alice", "sasl_plain_password": SECRET,
                      "ssl_cafile": "/etc/kafka/ca.pem", "ssl_check_hostname": False}
    for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):
        assert set(kwargs) <= set(client.DEFAULT_CONFIG), client  # names every client knows
    ssl_only = KafkaSecurity(security_protocol="SSL", ssl_cafile="ca.pem").kafka_python()
    assert ssl_only == {"security_protocol": "SSL", "ssl_cafile": "ca.pem", "ssl_check_hostname": True}
    sasl_plaintext = KafkaSecurity(security_protocol="SASL_PLAINTEXT", username="u", password="p").kafka_python()
    assert not any(k.startswith("ssl_") for k in sasl_plaintext)


def test_aiokafka_gets_a_verifying_ssl_context(ca_file):
    import aiokafka

    kwargs = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", username="alice",
                           password=SECRET, ssl_cafile=ca_file).aiokafka()
    context = kwargs.pop("ssl_context")
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert kwargs == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                      "sasl_plain_username": "alice", "sasl_plain_password": SECRET}

    async def construct() -> None:  # aiokafka takes exactly these arguments (its constructor checks them)
        aiokafka.AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", ssl_context=context, **kwargs)

    asyncio.run(construct())
    unchecked = KafkaSecurity(security_protocol="SSL", ssl_cafile=ca_file, ssl_check_hostname=False)
    context = unchecked.aiokafka()["ssl_context"]
    assert context.verify_mode == ssl.CERT_REQUIRED and not context.check_hostname  # the chain is still checked


def test_faust_gets_broker_credentials(ca_file):
    creds = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", username="alice",
                          password=SECRET, ssl_cafile=ca_file).faust()["broker_credentials"]
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.protocol.value, creds.mechanism.value, creds.username) == ("SASL_SSL", "SCRAM-SHA-256", "alice")
    assert isinstance(creds.ssl_context, ssl.SSLContext)
    plain = KafkaSecurity(security_protocol="SASL_PLAINTEXT", username="a", password="b").faust()["broker_credentials"]
    assert plain.protocol.value == "SASL_PLAINTEXT" and plain.ssl_context is None
    tls = KafkaSecurity(security_protocol="SSL", ssl_cafile=ca_file).faust()["broker_credentials"]
    assert isinstance(tls, faust.SSLCredentials) and tls.protocol.value == "SSL"


def test_faust_app_turns_the_credentials_into_the_same_aiokafka_arguments(ca_file):
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    sec = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", username="alice",
                        password=SECRET, ssl_cafile=ca_file)
    app = faust.App("security-test", broker="kafka://127.0.0.1:1", **sec.faust())
    auth = credentials_to_aiokafka_auth(app.conf.broker_credentials, app.conf.ssl_context)
    assert {k: v for k, v in auth.items() if k != "ssl_context"} == {
        k: v for k, v in sec.aiokafka().items() if k != "ssl_context"}
    assert isinstance(auth["ssl_context"], ssl.SSLContext)


def test_auth_errors_become_one_line_without_the_password():
    refused = SaslAuthenticationFailedError("Authentication failed due to invalid credentials with SASL mechanism")
    line = auth_error_line(refused, "broker:9093")
    assert line.startswith("Kafka at broker:9093 refused the SASL login") and "\n" not in line
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
    assert "TLS to Kafka at broker:9093 failed" in auth_error_line(wrapped, "broker:9093")
    assert auth_error_line(KafkaTimeoutError("Unable to bootstrap"), "broker:9093") is None
    # Not a Kafka error, or no security configured: nothing to ask the broker about.
    assert explain_failure(ValueError("x"), "broker:9093", Settings.from_env(SASL_ENV).security) is None
    assert explain_failure(KafkaTimeoutError("Unable to bootstrap"), "127.0.0.1:1", PLAINTEXT) is None


def test_from_env_hands_the_security_to_the_shipper_in_its_environment_not_its_command_line(tmp_path):
    import json

    from rankwatch.producers import RankPublisher

    env = {**SASL_ENV, "RANKWATCH_RUN": "r", "RANKWATCH_BOOTSTRAP": "127.0.0.1:1", "RANKWATCH_SPOOL_DIR": str(tmp_path)}
    pub = RankPublisher.from_env(env, rank=0, world_size=1, drain_s=0, connect_timeout_s=0.5, samplers=[],
                                 producer_config={"acks": 1})
    try:
        config = json.loads(pub._shipper._config)  # what the shipper process gets as RANKWATCH_PRODUCER_CONFIG
        args = pub._shipper._args
    finally:
        pub.close(timeout_s=10)
    assert config["security_protocol"] == "SASL_SSL" and config["sasl_plain_password"] == SECRET
    assert config["acks"] == 1  # a given producer_config adds to the settings' security
    assert not any(SECRET in arg for arg in args)


def test_no_broker_at_the_address_is_one_error_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from rankwatch import sinks
    from rankwatch.broker import free_port
    from rankwatch.cli import main
    from rankwatch.sinks import reader

    monkeypatch.setattr(reader, "BOOTSTRAP_TIMEOUT_S", 1.0)  # nothing listens there: no need to wait 10 s
    nowhere = f"127.0.0.1:{free_port()}"
    assert main(["alerts", "--bootstrap", nowhere]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rankwatch: error: no Kafka broker answered at {nowhere}: start one with `rankwatch up`")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert client_error_line(KafkaConnectionError("refused"), "b:9092").startswith("no Kafka broker answered at b:9092")
    assert client_error_line(MessageSizeTooLargeError("1,027,630 bytes"), "b:9092") == \
        "Kafka at b:9092: [Error 10] MessageSizeTooLargeError: 1,027,630 bytes"
    assert client_error_line(KafkaTimeoutError(), "b:9092") == "Kafka at b:9092: KafkaTimeoutError"

    def bug(*args, **kwargs):
        raise ValueError("not a Kafka client's failure")

    monkeypatch.setattr(sinks, "read_topic", bug)
    with pytest.raises(ValueError):
        main(["alerts", "--bootstrap", "127.0.0.1:1"])


def test_a_refused_login_is_one_error_before_any_kafka_python_client(monkeypatch):
    """``check_login`` asks once per configuration (the SASL_SSL test broker: tests/test_kafka_security.py)."""
    from rankwatch import security
    from rankwatch.errors import LoginError

    asked = []
    answer = {"cause": SaslAuthenticationFailedError("invalid credentials")}
    monkeypatch.setattr(security, "probe", lambda bootstrap, sec: asked.append(bootstrap) or answer["cause"])
    monkeypatch.setattr(security, "_LOGINS_CHECKED", set())
    sasl = Settings.from_env(SASL_ENV).security

    security.check_login("127.0.0.1:1", PLAINTEXT)
    assert asked == [], "PLAINTEXT has no login to check"
    with pytest.raises(LoginError, match="refused the SASL login") as refused:
        security.check_login("broker:9093", sasl)
    assert SECRET not in str(refused.value)
    answer["cause"] = None  # let in (or not answering: the caller's retries decide)
    security.check_login("broker:9093", sasl)
    security.check_login("broker:9093", sasl)
    assert asked == ["broker:9093", "broker:9093"], "a login let in is not asked again"

    async def inside_a_loop() -> None:
        security.check_login("other:9093", sasl)

    asyncio.run(inside_a_loop())
    assert asked == ["broker:9093", "broker:9093"], "probe runs its own event loop: not from inside one"
