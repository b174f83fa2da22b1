"""From a request's credentials to a configured tenant, and each tenant's usage counts.

The directory holds the tenants of the running config and the keys of the
keys file, both swapped whole on reload (a config reload, or the file's
content changing: a mounted Secret is replaced atomically by the kubelet), so
a request sees one consistent table. Usage counters live on the `Tenant`
(plain integers, read by the metrics collector at scrape time) and survive a
reload for the tenants that stay: the label set is the configured tenants,
nothing a client can invent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from contract.config import TenantsConfig
from contract.errors import Unauthorized
from picker.tenants.keys import KeyFileError, StoredKey, bearer, read_keys, split_key

log = logging.getLogger("picker.tenants")

KEYS_POLL_S = 1.0

# What tells a changed keys file: mtime in ns, size and inode (a Secret swaps the file).
_Signature = tuple[int, int, int]


@dataclass(slots=True)
class Usage:
    """What one tenant sent, counted on the request path (integers, no locks: one loop)."""

    requests: int = 0
    prompt_tokens: int = 0
    reserved_tokens: int = 0
    rate_limited: int = 0
    # reported after the request ended (picker.tenants.usage); `estimated` is the part
    # counted from a stream's events because the stream carried no usage object
    output_tokens: int = 0
    output_tokens_estimated: int = 0


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float
    usage: Usage = field(default_factory=Usage)


@dataclass(slots=True)
class KeyStats:
    """The keys file's state and the refused credentials, for the metrics."""

    keys: int = 0
    reloads_applied: int = 0
    reloads_refused: int = 0
    missing: int = 0  # no credential where one is required
    invalid: int = 0  # a credential that is not a key, or no such key, or a wrong secret
    unknown_tenant: int = 0  # a valid key or claim naming no configured tenant


class TenantDirectory:
    """The configured tenants and how a request is matched to one of them."""

    def __init__(self, config: TenantsConfig | None = None) -> None:
        self.config: TenantsConfig | None = None
        self.tenants: dict[str, Tenant] = {}
        self.stats = KeyStats()
        self._keys: dict[str, StoredKey] = {}
        self._keys_path: str | None = None
        self._signature: _Signature | None = None  # None: not read yet
        self.configure(config)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def configure(self, config: TenantsConfig | None) -> None:
        """Adopt a (re)loaded `spec.tenants`; counters carry over for tenants that stay."""
        old = self.tenants
        self.config = config
        tenants: dict[str, Tenant] = {}
        for t in config.tenants if config is not None else ():
            kept = old.get(t.name)
            tenants[t.name] = Tenant(t.name, t.weight, kept.usage if kept else Usage())
        self.tenants = tenants
        path = config.keys_file if config is not None else None
        if path != self._keys_path:
            self._keys_path = path
            self._keys = {}
            self._signature = None
            self.refresh_keys()

    def identify(self, authorization: str | None, claim: str | None) -> Tenant | None:
        """The request's tenant; None when tenants are off. Unauthorized (401) for a
        missing, malformed or unknown credential."""
        config = self.config
        if config is None:
            return None
        if config.jwt_claim is not None:
            return self._by_claim(claim)
        credential = bearer(authorization)
        if credential is None:
            self.stats.missing += 1
            raise Unauthorized(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        parts = split_key(credential)
        key = self._keys.get(parts[0]) if parts is not None else None
        if key is None or not key.matches(parts[1]):
            self.stats.invalid += 1
            raise Unauthorized("Incorrect API key provided.")
        tenant = self.tenants.get(key.tenant)
        if tenant is None:
            self.stats.unknown_tenant += 1
            raise Unauthorized("Incorrect API key provided: its tenant is not configured.")
        return tenant

    def _by_claim(self, claim: str | None) -> Tenant:
        """Envoy verified the token and copied the claim into a header the client cannot
        set (stripped before jwt_authn runs)."""
        if not claim:
            self.stats.missing += 1
            raise Unauthorized("The token has no claim naming a tenant.")
        tenant = self.tenants.get(claim)
        if tenant is None:
            self.stats.unknown_tenant += 1
            raise Unauthorized("The token's tenant is not configured on this gateway.")
        return tenant

    # -- the keys file ---------------------------------------------------------------

    def refresh_keys(self) -> bool:
        """Re-read the keys file if it changed; a bad file keeps the keys in force."""
        path = self._keys_path
        if path is None:
            self.stats.keys = 0
            return False
        signature = _signature(path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            keys = read_keys(path)
        except KeyFileError as exc:
            self.stats.reloads_refused += 1
            log.error("tenant keys not (re)loaded, keeping %d keys: %s", len(self._keys), exc)
            return False
        unknown = sorted({k.tenant for k in keys.values()} - set(self.tenants))
        if unknown:
            log.warning("tenant keys for unconfigured tenants (refused): %s", ", ".join(unknown))
        self._keys = keys
        self.stats.keys = len(keys)
        self.stats.reloads_applied += 1
        log.info("tenant keys loaded: %d keys from %s", len(keys), path)
        return True

    async def watch(self, stopping: asyncio.Event) -> None:
        """Poll the keys file until the picker stops (a Secret update lands within a poll)."""
        while not stopping.is_set():
            await asyncio.sleep(KEYS_POLL_S)
            self.refresh_keys()


def _signature(path: str) -> _Signature:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    return (0, 0, 0)
