"""API keys and tenant identity: the key format, the hash file, reloads, every 401."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from contract.config import RateLimits, TenantConfig, TenantsConfig
from contract.errors import Unauthorized
from picker.tenants.identity import TenantDirectory
from picker.tenants.keys import KeyFileError, bearer, mint, parse_keys, split_key


def tenants_config(path, *names, claim=None) -> TenantsConfig:
    return TenantsConfig(
        tenants=tuple(TenantConfig(name=n, weight=2.0, limits=RateLimits()) for n in names),
        keys_file=None if claim else str(path),
        jwt_claim=claim,
    )


def test_a_minted_key_matches_its_stored_line_and_nothing_else():
    key, stored = mint("team-a")
    assert key.startswith(f"igw_{stored.key_id}_")
    key_id, secret = split_key(key)
    assert key_id == stored.key_id and stored.matches(secret)
    assert not stored.matches(secret[:-1] + ("A" if secret[-1] != "A" else "B"))
    assert secret not in stored.line() and key not in stored.line()
    (again,) = parse_keys(stored.line() + "  # alice\n", "f").values()
    assert again == stored
    # the same secret under another salt gives another digest
    assert mint("team-a")[1].digest != stored.digest


@pytest.mark.parametrize(
    "credential",
    ["", "igw", "igw__", "sk-abc", "igw_5194dbf36e9_" + "a" * 43, "igw_5194DBF36E95_" + "a" * 43,
     "igw_5194dbf36e95_short", "igw_5194dbf36e95_" + "a" * 200, "x" * 10_000,
     "igw_5194dbf36e95_" + "é" * 43],
)
def test_garbage_is_not_a_key(credential):
    assert split_key(credential) is None


def test_bearer():
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer   abc ") == "abc"
    assert bearer("Basic abc") is None
    assert bearer("Bearer") is None
    assert bearer(None) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("team-a 5194dbf36e95", "f:1: expected"),
        ("team-a 5194dbf36e9x sha256:00112233445566778899:" + "0" * 64, "f:1: key id"),
        ("team-a 5194dbf36e95 md5:0011223344556677:" + "0" * 64, "unknown hash scheme"),
        ("team-a 5194dbf36e95 sha256:0011:" + "0" * 64, "salt must be"),
        ("team-a 5194dbf36e95 sha256:0011223344556677:00", "digest"),
        ("# c\n\nteam-a 5194dbf36e95 sha256:0011223344556677:" + "0" * 64 + "\n"
         "team-b 5194dbf36e95 sha256:0011223344556677:" + "0" * 64, "f:4: duplicate key id"),
    ],
)
def test_bad_key_lines_name_the_line(text, message):
    with pytest.raises(KeyFileError, match=message):
        parse_keys(text, "f")


def test_identify_by_key_and_every_refusal(tmp_path):
    path = tmp_path / "keys"
    key_a, stored_a = mint("team-a")
    key_gone, stored_gone = mint("gone")
    path.write_text(f"{stored_a.line()}\n{stored_gone.line()}\n")
    directory = TenantDirectory(tenants_config(path, "team-a", "team-b"))
    tenant = directory.identify(f"Bearer {key_a}", None)
    assert (tenant.name, tenant.weight) == ("team-a", 2.0)
    refusals = [None, "Bearer", "Basic " + key_a, f"Bearer {key_a}x", "Bearer igw_garbage",
                f"Bearer {key_a[:-2]}zz", f"Bearer {key_gone}"]
    for authorization in refusals:
        with pytest.raises(Unauthorized) as info:
            directory.identify(authorization, None)
        assert info.value.status == 401 and info.value.code == "invalid_api_key"
    s = directory.stats
    assert (s.missing, s.invalid, s.unknown_tenant, s.keys) == (3, 3, 1, 2)


def test_keys_file_reload_adds_removes_and_keeps_the_old_on_a_bad_file(tmp_path):
    path = tmp_path / "keys"
    key_a, stored_a = mint("team-a")
    key_b, stored_b = mint("team-a")
    path.write_text(stored_a.line() + "\n")
    directory = TenantDirectory(tenants_config(path, "team-a"))
    assert directory.identify(f"Bearer {key_a}", None).name == "team-a"
    assert not directory.refresh_keys()  # unchanged: not read again
    path.write_text(stored_b.line() + "\n")
    os.utime(path, ns=(1, 1))  # a different mtime even within the clock's resolution
    assert directory.refresh_keys()
    assert directory.identify(f"Bearer {key_b}", None).name == "team-a"
    with pytest.raises(Unauthorized):
        directory.identify(f"Bearer {key_a}", None)
    path.write_text("not a key line\n")
    assert not directory.refresh_keys()
    assert directory.identify(f"Bearer {key_b}", None).name == "team-a"
    assert (directory.stats.reloads_applied, directory.stats.reloads_refused) == (2, 1)


def test_a_missing_keys_file_refuses_every_key_until_it_appears(tmp_path):
    path = tmp_path / "keys"
    directory = TenantDirectory(tenants_config(path, "team-a"))
    assert directory.stats.reloads_refused == 1
    key, stored = mint("team-a")
    with pytest.raises(Unauthorized):
        directory.identify(f"Bearer {key}", None)
    path.write_text(stored.line())
    assert directory.refresh_keys()
    assert directory.identify(f"Bearer {key}", None).name == "team-a"


def test_usage_survives_a_reconfigure_for_tenants_that_stay(tmp_path):
    path = tmp_path / "keys"
    path.write_text("")
    directory = TenantDirectory(tenants_config(path, "team-a", "team-b"))
    directory.tenants["team-a"].usage.requests = 5
    directory.configure(tenants_config(path, "team-a", "team-c"))
    assert directory.tenants["team-a"].usage.requests == 5
    assert set(directory.tenants) == {"team-a", "team-c"}
    directory.configure(None)
    assert directory.identify(None, None) is None and not directory.enabled


def test_identify_by_jwt_claim(tmp_path):
    directory = TenantDirectory(tenants_config(tmp_path, "team-a", claim="org"))
    assert directory.identify("Bearer whatever", "team-a").name == "team-a"
    for claim in (None, "", "team-z"):
        with pytest.raises(Unauthorized):
            directory.identify(None, claim)


def test_igw_tenants_add_and_remove_key(tmp_path):
    path = tmp_path / "keys"

    def igw(*args):
        return subprocess.run([sys.executable, "-m", "igw.cli", "tenants", *args],
                              capture_output=True, text=True, timeout=60)

    first = igw("add-key", "team-a", "--keys-file", str(path), "--comment", "alice")
    second = igw("add-key", "team-b", "--keys-file", str(path))
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    key_a, key_b = first.stdout.strip(), second.stdout.strip()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert key_a not in path.read_text() and "# alice" in path.read_text()
    directory = TenantDirectory(tenants_config(path, "team-a", "team-b"))
    assert directory.identify(f"Bearer {key_b}", None).name == "team-b"
    removed = igw("remove-key", split_key(key_a)[0], "--keys-file", str(path))
    assert removed.returncode == 0, removed.stderr
    directory = TenantDirectory(tenants_config(path, "team-a", "team-b"))
    with pytest.raises(Unauthorized):
        directory.identify(f"Bearer {key_a}", None)
    assert directory.identify(f"Bearer {key_b}", None).name == "team-b"
    printed = igw("add-key", "team-c")
    assert printed.returncode == 0 and "igw_" in printed.stderr
    assert parse_keys(printed.stdout, "stdout")
    assert igw("add-key", "bad name").returncode == 2
    assert igw("remove-key", "000000000000", "--keys-file", str(path)).returncode == 1
