"""One exception root, so callers can catch everything rankwatch raises on purpose."""


class RankwatchError(Exception):
    """Base of every error rankwatch raises deliberately."""


class SchemaError(RankwatchError, ValueError):
    """Bytes that do not form a valid rankwatch event; the message says what is wrong."""


class BrokerError(RankwatchError):
    """The broker could not be started or reached."""


class LoginError(BrokerError):
    """The broker refused the client's SASL login or TLS handshake; the message says which, without secrets."""
