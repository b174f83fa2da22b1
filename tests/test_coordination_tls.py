"""Coordination over TLS with an ACL user, as on ElastiCache with in-transit encryption
and RBAC: a real redis-server on a TLS port (certificate from our own CA), the
password in a file as a mounted Secret is. A wrong password or an untrusted
certificate leaves the replica routing on its own, and says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.config import ConfigError, parse_config
from igw_envoy.tls import TlsFiles, ensure_self_signed
from tests.test_coordination import connected, start_pair
from tests.test_coordination_support import (
    Replica,
    config_doc,
    eventually,
    long_prompt,
    redis_server,
)

USER = ("--user", "gateway", "on", ">s3cret-pass", "~*", "&*", "+@all",
        "--user", "default", "off")


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return ensure_self_signed(tmp_path, ("127.0.0.1", "localhost"))


def _secret(tmp_path: Path, password: str) -> str:
    path = tmp_path / "redis-password"
    path.write_text(password + "\n")  # a Secret's file often ends with a newline
    return str(path)


async def test_replicas_share_over_tls_with_an_acl_user(tls, tmp_path):
    with redis_server(*USER, tls=tls) as redis:
        assert redis.url.startswith("rediss://")
        config = parse_config(config_doc(
            redis.url, username="gateway", passwordFile=_secret(tmp_path, "s3cret-pass"),
            caFile=str(tls.ca_cert)))
        a, b = start_pair(config)
        try:
            await eventually(lambda: connected(a, b), 5)
            decision = a.route(long_prompt("tls"))
            row = b.row(decision.address)
            await eventually(lambda: b.pool.table.inflight[row] == 1, 3)
            a.complete_all()
            await eventually(lambda: b.inflight() == 0, 3)
        finally:
            await a.coordinator.stop()
            await b.coordinator.stop()


@pytest.mark.parametrize("case", ["wrong password", "untrusted certificate", "plain text"])
async def test_a_refused_connection_routes_alone_and_says_why(case, tls, tmp_path):
    with redis_server(*USER, tls=tls) as redis:
        fields = {"username": "gateway", "passwordFile": _secret(tmp_path, "s3cret-pass"),
                  "caFile": str(tls.ca_cert)}
        url, expected = redis.url, ""
        if case == "wrong password":
            fields["passwordFile"] = _secret(tmp_path, "guess")
            expected = "AuthenticationError"
        elif case == "untrusted certificate":
            del fields["caFile"]  # the system trust store does not know our CA
            expected = "CERTIFICATE_VERIFY_FAILED"
        else:
            del fields["caFile"]
            url = url.replace("rediss://", "redis://")  # a TLS port spoken to in clear
            expected = "Error"
        replica = Replica.make(parse_config(config_doc(url, **fields)), "alone")
        replica.coordinator.start()
        try:
            await eventually(lambda: replica.coordinator.stats.last_error != "", 5)
            stats = replica.coordinator.stats
            assert not stats.connected
            assert expected in stats.last_error, stats.last_error
            assert "s3cret" not in stats.last_error and "guess" not in stats.last_error
            replica.route(long_prompt("alone"))  # routing never waits for Redis
            assert replica.inflight() == 1
        finally:
            await replica.coordinator.stop()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("caFile", "/etc/ssl/ca.pem", "only with a rediss:// url"),
    ("username", "", "expected a non-empty string"),
    ("passwordFile", 7, "expected a non-empty string"),
])
def test_tls_and_auth_fields_are_checked(field, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config_doc("redis://127.0.0.1:6379/0", **{field: value}))
