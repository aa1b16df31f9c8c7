"""SASL user names reach the real broker as it reads them: SCRAM's saslname escapes ``,`` and
``=`` (RFC 5802), which kafka-python does not write, so a SCRAM user named ``a,b`` or ``a=b``
failed its login as if its password were wrong; a name the broker can never log in (empty, a
non-ASCII one under SCRAM, a NUL anywhere) is refused at load, naming the key, where it read as a
wrong password at every connect."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuslo.core.settings import KafkaSettings, SettingsError
from tests.servers.kafka import KafkaBroker

SCRAM_NAMES = ["a,b", "a=b", "x=2Cy", "=,=", "a b~!", "plain"]


def _scram(bootstrap: str, user: str, password: str = "pw-1") -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=[bootstrap], security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="SCRAM-SHA-256", sasl_username=user, sasl_password=password)  # fmt: skip


@pytest.mark.integration
def test_a_scram_user_with_commas_or_equals_logs_in_on_the_real_broker(kafka: KafkaBroker) -> None:
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin._users import UserScramCredentialUpsertion
    from kafka.errors import KafkaError

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        made = admin.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(u, "SCRAM-SHA-256", "pw-1") for u in [*SCRAM_NAMES, "é"]]
        )
    finally:
        admin.close()
    assert made == dict.fromkeys([*SCRAM_NAMES, "é"])
    # the broker keeps a non-ASCII user, and never logs it in (its saslname is ASCII): refused at load
    with pytest.raises(KafkaError):  # kafka-python's bootstrap gives up: the broker closes each login
        KafkaProducer(bootstrap_servers=kafka.sasl_bootstrap, security_protocol="SASL_PLAINTEXT",
                      sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="é", sasl_plain_password="pw-1",
                      bootstrap_timeout_ms=8000, max_block_ms=8000).close()  # fmt: skip
    for user in SCRAM_NAMES:
        kw = _scram(kafka.sasl_bootstrap, user).client_kwargs()
        p = KafkaProducer(bootstrap_timeout_ms=20_000, max_block_ms=20_000, **kw)
        try:
            p.send("scram-names", user.encode()).get(timeout=20)
        finally:
            p.close()


@pytest.mark.parametrize(
    ("mechanism", "user", "says"),
    [
        ("SCRAM-SHA-256", "", "empty"),
        ("SCRAM-SHA-512", "", "empty"),
        ("PLAIN", "", "empty"),
        ("SCRAM-SHA-256", "é", "ASCII"),
        ("SCRAM-SHA-512", "用户", "ASCII"),
        ("SCRAM-SHA-256", "a\x00b", "NUL"),
        ("PLAIN", "a\x00b", "NUL"),
    ],
)
def test_a_user_name_the_broker_cannot_log_in_is_refused_at_load(
    mechanism: str, user: str, says: str
) -> None:
    with pytest.raises(ValidationError, match="sasl_username") as e:
        KafkaSettings(
            security_protocol="SASL_SSL", sasl_mechanism=mechanism, sasl_username=user, sasl_password="x"
        )
    assert says in str(e.value)


def test_names_plain_takes_pass_as_written_and_a_nul_in_its_password_is_refused() -> None:
    kw = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="a,b=é",
                       sasl_password="p,w=").client_kwargs()  # fmt: skip
    assert (kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("a,b=é", "p,w=")
    assert _scram("h:1", "a,b=c").client_kwargs()["sasl_plain_username"] == "a=2Cb=3Dc"
    with pytest.raises(SettingsError, match="sasl_password"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                      sasl_password="a\x00b").client_kwargs()  # fmt: skip
