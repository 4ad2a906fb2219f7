"""Kafka client security (SASL and TLS): one frozen config, converted for each Kafka client library.

rankwatch talks to Kafka through three libraries: kafka-python (publishers' shippers, sinks, the CLI
and admin chores), aiokafka (the worker's broker watch) and Faust (the worker's app, on aiokafka).
Each spells the same settings differently; :class:`KafkaSecurity` holds them once, and
:meth:`~KafkaSecurity.kafka_python`, :meth:`~KafkaSecurity.aiokafka` and :meth:`~KafkaSecurity.faust`
give each its keyword arguments. ``Settings.security`` builds it from ``RANKWATCH_SECURITY_PROTOCOL``,
``RANKWATCH_SASL_MECHANISM``, ``RANKWATCH_SASL_USERNAME``, ``RANKWATCH_SASL_PASSWORD`` (or
``RANKWATCH_SASL_PASSWORD_FILE``), ``RANKWATCH_SSL_CAFILE``, ``RANKWATCH_SSL_CERTFILE``,
``RANKWATCH_SSL_KEYFILE`` and ``RANKWATCH_SSL_CHECK_HOSTNAME``.

The password never prints itself: ``repr`` masks it, and :func:`auth_error_line` turns a client's
authentication or TLS failure into one line that names the cause, not the secret.

>>> sec = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
...                     username="alice", password="s3cret", ssl_cafile="/etc/kafka/ca.pem")
>>> sec
KafkaSecurity(security_protocol='SASL_SSL', sasl_mechanism='SCRAM-SHA-512', username='alice', password='***', ssl_cafile='/etc/kafka/ca.pem', ssl_certfile='', ssl_keyfile='', ssl_check_hostname=True)
>>> sorted(sec.kafka_python())
['sasl_mechanism', 'sasl_plain_password', 'sasl_plain_username', 'security_protocol', 'ssl_cafile', 'ssl_check_hostname']
>>> KafkaSecurity().kafka_python()  # PLAINTEXT: the clients' defaults, nothing added
{}
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rankwatch.errors import LoginError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
_MASK = "***"


@dataclass(frozen=True, kw_only=True, repr=False)
class KafkaSecurity:
    """How every rankwatch Kafka client authenticates and encrypts; the default is PLAINTEXT (none).

    ``ssl_cafile`` empty means the system's CAs; ``ssl_certfile``/``ssl_keyfile`` are a client
    certificate (mutual TLS), the key may be inside the certificate file.
    """

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    username: str = ""
    password: str = ""
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        if self.security_protocol not in PROTOCOLS:
            raise ValueError(f"security_protocol must be one of {PROTOCOLS}, got {self.security_protocol!r}")
        if self.sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise ValueError(f"sasl_mechanism must be one of {MECHANISMS}, got {self.sasl_mechanism!r}")
            if not self.username or not self.password:
                raise ValueError(f"{self.security_protocol} needs a SASL username and password "
                                 "(RANKWATCH_SASL_USERNAME, RANKWATCH_SASL_PASSWORD or RANKWATCH_SASL_PASSWORD_FILE)")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile (the client certificate it belongs to)")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol.endswith("SSL")

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={_MASK if f.name == 'password' and self.password else getattr(self, f.name)!r}"
                          for f in fields(self))
        return f"{type(self).__name__}({shown})".replace(f"password={_MASK}", f"password='{_MASK}'")

    __str__ = __repr__

    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's KafkaProducer, KafkaConsumer and KafkaAdminClient.

        Plain values only (no SSL context): the publisher hands them to its shipper process as JSON.
        """
        kwargs = self._protocol_and_sasl()
        if self.tls:
            kwargs["ssl_check_hostname"] = self.ssl_check_hostname
            kwargs.update({k: v for k, v in (("ssl_cafile", self.ssl_cafile), ("ssl_certfile", self.ssl_certfile),
                                             ("ssl_keyfile", self.ssl_keyfile)) if v})
        return kwargs

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's AIOKafkaConsumer / AIOKafkaProducer (TLS as an ``ssl_context``)."""
        kwargs = self._protocol_and_sasl()
        if self.tls:
            kwargs["ssl_context"] = self.ssl_context()
        return kwargs

    def _protocol_and_sasl(self) -> dict[str, Any]:
        """What kafka-python and aiokafka name alike: the protocol and the SASL login ({} for PLAINTEXT)."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.sasl:
            kwargs.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.username,
                          sasl_plain_password=self.password)
        return kwargs

    def faust(self) -> dict[str, Any]:
        """Faust App settings: ``broker_credentials`` (``faust.SASLCredentials`` or ``faust.SSLCredentials``).

        Faust's aiokafka transport turns these into the same aiokafka arguments for its consumer,
        producer and the client that creates topics (``credentials_to_aiokafka_auth``).
        """
        if self.security_protocol == "PLAINTEXT":
            return {}
        import faust

        context = self.ssl_context() if self.tls else None
        if not self.sasl:
            return {"broker_credentials": faust.SSLCredentials(context)}
        # With an ssl_context SASLCredentials says SASL_SSL, without it SASL_PLAINTEXT.
        return {"broker_credentials": faust.SASLCredentials(username=self.username, password=self.password,
                                                            mechanism=self.sasl_mechanism, ssl_context=context)}

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context: the broker's certificate checked against ``ssl_cafile`` (or the system's CAs)."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile or None)
        context.check_hostname = self.ssl_check_hostname  # the certificate itself is still verified
        if self.ssl_certfile:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile or None)
        return context


PLAINTEXT = KafkaSecurity()


def read_password(password: str, password_file: str) -> str:
    """The SASL password: ``password`` if given, else the first line of ``password_file`` (a mounted secret)."""
    if password or not password_file:
        return password
    try:
        text = Path(password_file).read_text()
    except OSError as exc:
        raise ValueError(f"RANKWATCH_SASL_PASSWORD_FILE: cannot read {password_file} ({exc.strerror})") from None
    return text.splitlines()[0] if text.strip() else ""


def explain_failure(exc: BaseException, bootstrap: str, security: KafkaSecurity) -> str | None:
    """One line naming a login or TLS failure behind ``exc`` (a Kafka client's error); None if it was not one.

    kafka-python loses the broker's "authentication failed" answer (it reads the close that follows
    first) and retries until its bootstrap times out: ``KafkaTimeoutError: Unable to bootstrap``. So
    when ``exc`` names no cause and ``security`` is not PLAINTEXT, one aiokafka connection asks again;
    aiokafka reports the broker's reason. The line never holds the password.
    """
    line = auth_error_line(exc, bootstrap)
    if line is not None or security.security_protocol == "PLAINTEXT" or not is_client_failure(exc):
        return line
    cause = probe(bootstrap, security)
    return None if cause is None else auth_error_line(cause, bootstrap)


_LOGINS_CHECKED: set[tuple[str, KafkaSecurity]] = set()


def check_login(bootstrap: str, security: KafkaSecurity) -> None:
    """Raise ``LoginError`` at once when the cluster refuses this login or TLS handshake.

    A kafka-python client says so only when its 30 s bootstrap timeout ends, and then only as
    "Unable to bootstrap" (see ``explain_failure``): a user with a wrong password waited half a
    minute for the error line. One aiokafka connection hears the broker's answer in well under a
    second. Checked once per process and configuration; anything but a refusal (a broker not up
    yet, say) is left to the caller's own retries.
    """
    import asyncio

    if security.security_protocol == "PLAINTEXT" or (bootstrap, security) in _LOGINS_CHECKED:
        return
    try:
        asyncio.get_running_loop()
        return  # inside an event loop (``probe`` runs its own): the caller's error path explains a refusal
    except RuntimeError:
        pass
    cause = probe(bootstrap, security)
    line = None if cause is None else auth_error_line(cause, bootstrap)
    if line is not None:
        raise LoginError(line)
    _LOGINS_CHECKED.add((bootstrap, security))


def probe(bootstrap: str, security: KafkaSecurity, timeout_s: float = 10.0) -> BaseException | None:
    """Connect once with aiokafka; the login or TLS failure it met (None if it got in, or failed otherwise)."""
    import asyncio

    import aiokafka

    async def connect() -> None:
        client = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap.split(","), enable_auto_commit=False,
                                           request_timeout_ms=int(timeout_s * 1000), **security.aiokafka())
        try:
            await asyncio.wait_for(client.start(), timeout_s)
        finally:
            await client.stop()

    with noting_auth_failures("aiokafka") as noted:  # aiokafka logs the broker's reason, then raises a bare error
        try:
            asyncio.run(connect())
        except Exception as exc:
            return exc if _auth_cause(exc) is not None else noted.last
    return None


class AuthFailures(logging.Handler):
    """Keeps the last login or TLS failure that a Kafka client logged (attached by :func:`noting_auth_failures`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in (*args, record.exc_info[1] if record.exc_info else None):
            if isinstance(arg, BaseException) and _auth_cause(arg) is not None:
                self.last = arg


@contextmanager
def noting_auth_failures(logger: str) -> Iterator[AuthFailures]:
    """An :class:`AuthFailures` on ``logger`` meanwhile (and the logger's lines kept off stderr)."""
    handler, log = AuthFailures(), logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def auth_error_line(exc: BaseException, bootstrap: str) -> str | None:
    """One line for a Kafka client's authentication or TLS failure (None for any other error).

    Names the cause without the password; the clients' own messages carry the broker's reason.
    """
    cause = _auth_cause(exc)
    if cause is None:
        return None
    kind, err = cause
    if kind == "sasl":
        return (f"Kafka at {bootstrap} refused the SASL login (check RANKWATCH_SASL_USERNAME, the password and "
                f"RANKWATCH_SASL_MECHANISM): {_first_line(err)}")
    if kind == "authz":
        return f"Kafka at {bootstrap} refused this user: {_first_line(err)}"
    return (f"TLS to Kafka at {bootstrap} failed (check RANKWATCH_SECURITY_PROTOCOL, RANKWATCH_SSL_CAFILE and the "
            f"broker's certificate): {_first_line(err)}")


def client_error_line(exc: BaseException, bootstrap: str) -> str:
    """One line for a Kafka client's failure that was no refused login (``explain_failure`` names those):
    most often nothing answered at ``bootstrap``, which kafka-python says only as a timeout."""
    names, text = {cls.__name__ for cls in type(exc).__mro__}, _first_line(exc)
    if names & {"NoBrokersAvailable", "KafkaConnectionError"} or "bootstrap" in text.lower():
        return (f"no Kafka broker answered at {bootstrap}: start one with `rankwatch up` or `rankwatch broker`, "
                f"or give the address of yours with --bootstrap or $RANKWATCH_BOOTSTRAP")
    return f"Kafka at {bootstrap}: {text if type(exc).__name__ in text else f'{type(exc).__name__}: {text}'}"


_SASL_ERRORS = {"SaslAuthenticationFailedError", "SaslAuthenticationFailed", "AuthenticationFailedError"}


def _auth_cause(exc: BaseException | None) -> tuple[str, BaseException] | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names = {cls.__name__ for cls in type(exc).__mro__}
        if names & _SASL_ERRORS:  # kafka-python's and aiokafka's classes, by name: neither is imported for this
            return "sasl", exc
        if "AuthorizationError" in names or "ClusterAuthorizationFailedError" in names:
            return "authz", exc
        if isinstance(exc, ssl.SSLError):
            return "tls", exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_client_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a Kafka client (kafka-python's or aiokafka's KafkaError) or a TLS handshake."""
    return _auth_cause(exc) is not None or any(cls.__name__ == "KafkaError" for cls in type(exc).__mro__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
