"""SASL_SSL on a real Apache Kafka: one configuration (RANKWATCH_SECURITY_PROTOCOL, RANKWATCH_SASL_*,
RANKWATCH_SSL_CAFILE) reaches the publisher and its shipper, the worker, the store sink and the CLI.

The module makes its own CA and broker certificate with openssl and starts one KRaft node with a
SASL_SSL listener (SCRAM-SHA-256, user made at format time); its PLAINTEXT listener is only for the
broker's own readiness check. Every rankwatch client here is given the SASL_SSL address only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import TEST_RULES, need_kafka

from rankwatch import contract
from rankwatch.broker import free_port
from rankwatch.kafka_broker import KafkaBroker
from rankwatch.producers import RankPublisher
from rankwatch.settings import Settings
from rankwatch.sinks.reader import read_topic
from rankwatch.stack import Stack

pytestmark = pytest.mark.broker

USER = "alice"
PASSWORD = f"rw-secret-{uuid.uuid4().hex}"  # unique: any appearance in output is a leak
WRONG = f"rw-wrong-{uuid.uuid4().hex}"
RANKWATCH = [sys.executable, "-m", "rankwatch"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_tls(d: Path) -> tuple[Path, Path]:
    """A CA, and a broker certificate it signed for 127.0.0.1; returns (CA PEM, broker key + certificate PEM)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
             "-days", "2", "-subj", "/CN=rankwatch test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "broker.key"), "-out", str(d / "broker.csr"),
             "-subj", "/CN=127.0.0.1")
    (d / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                                  "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                                  "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    _openssl("x509", "-req", "-in", str(d / "broker.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-out", str(d / "broker.crt"), "-days", "2", "-extfile", str(d / "broker.ext"))
    keystore = d / "broker.pem"  # Kafka's PEM keystore: the (unencrypted PKCS#8) key, then the certificate
    keystore.write_text((d / "broker.key").read_text() + (d / "broker.crt").read_text())
    return d / "ca.pem", keystore


@pytest.fixture(scope="module")
def secure(tmp_path_factory) -> dict[str, str]:
    """A SASL_SSL Apache Kafka; yields the RANKWATCH_* environment that reaches it as USER."""
    need_kafka()
    ca, keystore = make_tls(tmp_path_factory.mktemp("tls"))
    jaas = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    port = free_port()
    broker = KafkaBroker(
        port=free_port(), data_dir=tmp_path_factory.mktemp("kafka-sasl"),
        listeners={"SASL_SSL": port},
        properties={
            "sasl.enabled.mechanisms": "SCRAM-SHA-256",
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(keystore),
        },
        scram=[f"SCRAM-SHA-256=[name={USER},password={PASSWORD}]"],
    )
    with broker:
        yield {
            "RANKWATCH_BOOTSTRAP": f"127.0.0.1:{port}",
            "RANKWATCH_SECURITY_PROTOCOL": "SASL_SSL",
            "RANKWATCH_SASL_MECHANISM": "SCRAM-SHA-256",
            "RANKWATCH_SASL_USERNAME": USER,
            "RANKWATCH_SASL_PASSWORD": PASSWORD,
            "RANKWATCH_SSL_CAFILE": str(ca),
        }


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_")}


def test_a_nan_published_over_sasl_ssl_is_alerted_and_read_back_with_the_same_config(secure, tmp_path, capfd):
    run = f"sasl-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env(secure, data_dir=str(tmp_path / "rankwatch"), rollup_steps=10,
                                 rules=str(TEST_RULES))
    assert settings.security.security_protocol == "SASL_SSL"
    worker_output: list[str] = []
    with Stack(settings, embedded=False, echo=worker_output.append):
        # RankPublisher.from_env: the settings' security goes to the shipper process as its producer config.
        pub = RankPublisher.from_env({**secure, "RANKWATCH_RUN": run}, rank=0, world_size=1, linger_s=0.05,
                                     samplers=[])
        for step in range(30):
            pub.log({"loss": float("nan") if step == 20 else 1.0 / (step + 1)}, step=step)
        pub.close(timeout_s=60)
        assert pub.stats().sent > 0 and pub.stats().spooled == 0, pub.stats()

        found = []
        for record in read_topic(settings.bootstrap, contract.ALERTS, follow=True, stop_after_s=120,
                                 stop=lambda: bool(found), security=settings.security):
            alert = contract.Alert.from_bytes(record.value)
            if alert.run == run and alert.detector == "nonfinite":
                found.append(alert)
        assert found, "no nonfinite alert for the NaN within 120 s"
        assert (found[0].metric, found[0].step, found[0].rank) == ("loss", 20, 0)
        assert math.isnan(found[0].value)

        # The CLI, from the environment alone, reads the same alert.
        tail = subprocess.run([*RANKWATCH, "tail", contract.ALERTS], env={**_clean_env(), **secure},
                              capture_output=True, text=True, timeout=180)
        assert tail.returncode == 0, tail.stderr
        alerts = [json.loads(line) for line in tail.stdout.splitlines()]
        assert any(a["run"] == run and a["detector"] == "nonfinite" for a in alerts), tail.stdout[-2000:]
        store_log = Path(settings.data_dir, "store.log").read_text()
    shipper_output = capfd.readouterr()
    outputs = {"worker": "\n".join(worker_output), "store": store_log, "cli stdout": tail.stdout,
               "cli stderr": tail.stderr, "shipper": shipper_output.out + shipper_output.err}
    assert "rankwatch worker ready" in outputs["worker"]
    for name, text in outputs.items():
        assert PASSWORD not in text, f"the SASL password appears in the {name}'s output"


def test_a_wrong_password_is_one_clear_error_line_and_no_secret_is_shown(secure, tmp_path, capfd):
    wrong = {**secure, "RANKWATCH_SASL_PASSWORD": WRONG}
    tail = subprocess.run([*RANKWATCH, "tail", contract.ALERTS], env={**_clean_env(), **wrong},
                          capture_output=True, text=True, timeout=180)
    assert tail.returncode != 0
    lines = [line for line in tail.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, tail.stderr
    assert lines[0].startswith("rankwatch: error: Kafka at " + secure["RANKWATCH_BOOTSTRAP"])
    assert "refused the SASL login" in lines[0] and "SaslAuthenticationFailed" in lines[0], lines[0]
    assert tail.stdout == ""

    # A worker: the same line (behind its "no broker answered"), and it stops.
    worker = subprocess.run([*RANKWATCH, "worker"], capture_output=True, text=True, timeout=180,
                            env={**_clean_env(), **wrong, "RANKWATCH_DATA_DIR": str(tmp_path / "worker")})
    assert worker.returncode != 0
    worker_lines = [line for line in (worker.stdout + worker.stderr).splitlines() if line.strip()]
    assert len(worker_lines) == 1 and "refused the SASL login" in worker_lines[0], worker_lines

    # A publisher with the wrong password keeps its messages in the spool and says why, without the secret.
    pub = RankPublisher.from_env({**wrong, "RANKWATCH_RUN": "sasl-wrong", "RANKWATCH_SPOOL_DIR": str(tmp_path)},
                                 rank=0, world_size=1, linger_s=0.05, samplers=[], connect_timeout_s=2.0, drain_s=5.0)
    pub.log({"loss": 1.0}, step=0)
    pub.close(timeout_s=60)
    assert pub.stats().sent == 0 and pub.stats().spooled > 0
    shipper = capfd.readouterr()
    assert "rankwatch shipper: delivery to" in shipper.err  # it did say something
    for text in (tail.stdout, tail.stderr, worker.stdout, worker.stderr, shipper.out, shipper.err):
        assert WRONG not in text and PASSWORD not in text
