"""Why a Kafka client could not start, in words an operator can act on.

kafka-python reports every bootstrap failure as "Unable to bootstrap": a broker that is
down, a TLS handshake that failed and a wrong SASL password look the same (a Kafka 4
broker closes the connection after a failed SASL exchange). This module looks at the
exception and, when that says nothing more, at the servers themselves (one TCP connect
each) to tell them apart. It names the mechanism and the user, never the password.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from gpuslo.core.settings import KafkaSettings, kafka_address

Probe = Callable[[str, int, float], bool]


def tcp_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolves(host: str) -> bool:
    """Whether ``host`` has an address (a name no resolver knows read as "nothing accepts TCP
    connections there", sending the operator to look for a broker down)."""
    try:
        return bool(socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return False


def explain(
    settings: KafkaSettings,
    exc: BaseException,
    probe: Probe = tcp_open,
    resolve: Callable[[str], bool] = resolves,
) -> str:
    """One line: what failed, where, and what to check."""
    servers = ", ".join(settings.bootstrap_servers)
    name = type(exc).__name__
    who = f"SASL {settings.sasl_mechanism} as user {settings.sasl_username!r}"
    if "SaslAuthenticationFailed" in name or "Authentication" in name:
        return f"Kafka authentication failed at {servers} ({who}): {_redacted(settings, exc)}"
    if "UnsupportedSaslMechanism" in name:
        return f"Kafka at {servers} does not offer SASL {settings.sasl_mechanism}: {_redacted(settings, exc)}"
    reachable = [s for s in settings.bootstrap_servers if probe(*kafka_address(s), 3.0)]
    if not reachable:
        unknown = [s for s in settings.bootstrap_servers if not resolve(kafka_address(s)[0])]
        if unknown:
            names = ", ".join(kafka_address(s)[0] for s in unknown)
            return (f"no Kafka broker reachable at {servers}: {names} "
                    f"{'has' if len(unknown) == 1 else 'have'} no address (check the name)")  # fmt: skip
        return f"no Kafka broker reachable at {servers} (nothing accepts TCP connections there)"
    proto = settings.security_protocol
    if proto.startswith("SASL"):
        tls = (
            " (or the TLS handshake: check ssl_cafile and the broker's certificate)"
            if proto == "SASL_SSL"
            else ""
        )
        return (
            f"Kafka authentication failed at {', '.join(reachable)} ({who}): the broker accepts "
            f"connections but closed them during authentication{tls}; check the user, the password and "
            f"that the listener enables {settings.sasl_mechanism} ({name}: {_redacted(settings, exc)})"
        )
    if proto == "SSL":
        return (
            f"TLS handshake with Kafka at {', '.join(reachable)} failed: the broker accepts connections but "
            f"the handshake did not complete; check ssl_cafile, the client certificate and the host name "
            f"({name}: {_redacted(settings, exc)})"
        )
    return (
        f"Kafka at {', '.join(reachable)} accepts connections but does not answer as a broker on this "
        f"listener (is it a SASL or TLS port? security_protocol is {proto}) ({name}: {_redacted(settings, exc)})"
    )


def _redacted(settings: KafkaSettings, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    secret: Any = None
    try:
        secret = settings.client_kwargs().get("sasl_plain_password")
    except Exception:  # an unresolvable secret cannot appear in the text either
        secret = None
    if secret:
        text = text.replace(str(secret), "***")
    return text.splitlines()[0] if text else name_of(exc)


def name_of(exc: BaseException) -> str:
    return type(exc).__name__
