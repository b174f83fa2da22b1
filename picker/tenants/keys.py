"""API keys: their format, the salted hashes that are stored instead, and the O(1) check.

A key is `igw_<id>_<secret>`: `id` is 12 public hex digits that name the key,
`secret` 32 random bytes (base64url). The keys file holds one line per key,

    <tenant> <id> sha256:<salt hex>:<digest hex>    # optional comment

where digest = SHA-256(salt ‖ secret): the gateway never sees a key again
after `igw tenants add-key` printed it once. Checking a request is one dict
lookup on the id and one SHA-256 of ~60 bytes with a constant-time compare,
so no cache is needed. A slow password hash (scrypt, argon2) protects
guessable passwords; a 256-bit random secret cannot be guessed, so it would
only make every request slower (bench/tenant_keys.py measures the check).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

PREFIX = "igw"
ID_HEX_DIGITS = 12
SECRET_BYTES = 32
SALT_BYTES = 16
SCHEME = "sha256"
MAX_KEYS = 100_000
# Longest Authorization value looked at: a key is 4 + 12 + 1 + 43 characters.
MAX_KEY_CHARS = 128
_ID_RE = re.compile(rf"^[0-9a-f]{{{ID_HEX_DIGITS}}}$")
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{32,86}$")
_HEX_RE = re.compile(r"^[0-9a-f]+$")


class KeyFileError(ValueError):
    """The keys file cannot be used; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class StoredKey:
    """One key as the file stores it: whose it is and how to recognise its secret."""

    tenant: str
    key_id: str
    salt: bytes
    digest: bytes

    def matches(self, secret: str) -> bool:
        candidate = hashlib.sha256(self.salt + secret.encode()).digest()
        return hmac.compare_digest(candidate, self.digest)

    def line(self) -> str:
        return f"{self.tenant} {self.key_id} {SCHEME}:{self.salt.hex()}:{self.digest.hex()}"


def mint(tenant: str) -> tuple[str, StoredKey]:
    """A new key for `tenant`: the key (show it once) and what the keys file keeps."""
    key_id = secrets.token_hex(ID_HEX_DIGITS // 2)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    salt = secrets.token_bytes(SALT_BYTES)
    digest = hashlib.sha256(salt + secret.encode()).digest()
    return f"{PREFIX}_{key_id}_{secret}", StoredKey(tenant, key_id, salt, digest)


def split_key(key: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed key, None for anything else (no exception: a
    garbage credential is an ordinary 401, not an error path)."""
    if len(key) > MAX_KEY_CHARS:
        return None
    prefix, _, rest = key.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != PREFIX or not _ID_RE.match(key_id) or not _SECRET_RE.match(secret):
        return None
    return key_id, secret


def bearer(authorization: str | None) -> str | None:
    """The credential of `Authorization: Bearer <credential>` (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credential.strip() or None


def parse_keys(text: str, source: str) -> dict[str, StoredKey]:
    """id → key from a keys file's text; a bad line is an error naming it."""
    keys: dict[str, StoredKey] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key = _parse_line(line, f"{source}:{number}")
        if key.key_id in keys:
            raise KeyFileError(f"{source}:{number}: duplicate key id {key.key_id}")
        keys[key.key_id] = key
        if len(keys) > MAX_KEYS:
            raise KeyFileError(f"{source}: more than {MAX_KEYS} keys")
    return keys


def _parse_line(line: str, where: str) -> StoredKey:
    parts = line.split()
    if len(parts) != 3:
        raise KeyFileError(f"{where}: expected `<tenant> <key id> {SCHEME}:<salt>:<digest>`")
    tenant, key_id, stored = parts
    if not _ID_RE.match(key_id):
        raise KeyFileError(f"{where}: key id must be {ID_HEX_DIGITS} lower-case hex digits")
    scheme, _, rest = stored.partition(":")
    salt_hex, _, digest_hex = rest.partition(":")
    if scheme != SCHEME:
        raise KeyFileError(f"{where}: unknown hash scheme {scheme[:16]!r} (expected {SCHEME})")
    if not (_HEX_RE.match(salt_hex) and _HEX_RE.match(digest_hex)) or len(digest_hex) != 64:
        raise KeyFileError(f"{where}: salt and digest must be hex, the digest 32 bytes")
    if len(salt_hex) < 2 * 8 or len(salt_hex) % 2:
        raise KeyFileError(f"{where}: salt must be at least 8 bytes of hex")
    return StoredKey(tenant, key_id, bytes.fromhex(salt_hex), bytes.fromhex(digest_hex))


def read_keys(path: str | Path) -> dict[str, StoredKey]:
    """The keys file, parsed; KeyFileError when it cannot be read or a line is bad."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise KeyFileError(f"{path}: cannot read: {reason}") from None
    return parse_keys(text, str(path))
