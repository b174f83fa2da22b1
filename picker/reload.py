"""Config reload: the running config, and how a new one replaces it without a restart.

A new config comes from the watched file (polled, or SIGHUP) or from
discovery's config resource. An invalid one, or one that changes what only a
restart can change, is refused and the running config stays; every outcome is
counted and left in STATE_DIR/reload-status.json for operators. Each good file
is kept as STATE_DIR/config.last-good.yaml, which a restarted picker falls
back to when the file has been broken meanwhile.

A reload that adds a pool or a pod is applied in two steps, so that no
request is ever sent where Envoy cannot route it yet: first Envoy gets the
union of the old and the new clusters, routes and members; once its admin port
shows it runs them, the picker switches to the new config and the files are
written again for the new config alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from contract.config import ConfigError, GatewayConfig, load_config_text
from contract.endpoints import EndpointError, resolve_endpoints
from igw_envoy.atomic import write_atomic
from igw_envoy.eds import cluster_name, write_endpoints
from igw_envoy.xds import write_dynamic
from picker.datastore import Datastore
from picker.envoy_admin import EnvoyAdmin

log = logging.getLogger("picker.reload")

RELOAD_POLL_S = 1.0
# How long a reload waits for Envoy to run the new clusters/routes before the
# picker switches anyway (Envoy down or restarting: nothing is served meanwhile).
ENVOY_APPLY_TIMEOUT_S = 10.0
RELOAD_STATUS_FILE = "reload-status.json"
LAST_GOOD_FILE = "config.last-good.yaml"


def last_good_path(state_dir: Path) -> Path:
    return state_dir / LAST_GOOD_FILE


# What tells a changed config file: mtime in ns, size and inode.
Signature = tuple[int, int, int]


def load_initial(config_path: Path, state_dir: Path) -> tuple[GatewayConfig, Signature]:
    """The config to start with, and the file's signature for the watch.

    The signature is taken before the file is read: a change made while the
    picker starts is reloaded once it runs, never missed.
    """
    signature = file_signature(config_path)
    return _initial_config(config_path, state_dir), signature


def _initial_config(config_path: Path, state_dir: Path) -> GatewayConfig:
    """The config file; if it is invalid, the last good one this picker ran.

    A config file broken while the gateway runs is refused by the reload, but
    a picker restarted after a crash would then not start at all (and the
    gateway would stay down). So each good file is kept in the state dir,
    and a restart falls back to it, saying so.
    """
    last_good_file = last_good_path(state_dir)
    try:
        last_good: GatewayConfig | None = _read_config(last_good_file)[0]
    except ConfigError:
        last_good = None
    try:
        config, text = _read_config(config_path)
    except ConfigError as exc:
        if last_good is None:
            raise
        log.error(
            "%s is invalid (%s); starting with the last good config %s",
            config_path,
            exc,
            last_good_file,
        )
        return last_good
    if last_good is not None and (fields := restart_only_changes(last_good, config)):
        # `igw serve` writes the last good copy when it starts, so this is a restart
        # of the picker alone: Envoy still runs the old listener and ports
        log.error(
            "%s changes %s, which needs `igw serve` restarted; starting with the last "
            "good config %s",
            config_path,
            ", ".join(fields),
            last_good_file,
        )
        return last_good
    _keep_last_good(state_dir, text)
    return config


class ConfigReloader:
    """Holds the running config and decides whether and when a new one replaces it.

    The switch itself (every part adopting the config, Envoy's files written
    for it alone) is the `adopt` callback: the picker process owns the parts.
    Before a switch that adds pools or pods, this writes Envoy the union of
    old and new and waits for Envoy to run it.
    """

    def __init__(
        self,
        config: GatewayConfig,
        signature: Signature,
        config_path: Path,
        state_dir: Path,
        *,
        eds_dir: Path,
        datastore: Datastore,
        envoy: EnvoyAdmin,
        reloads: Counter,
        adopt: Callable[[GatewayConfig], None],
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.state_dir = state_dir
        self._eds_dir = eds_dir
        self._datastore = datastore
        self._envoy = envoy
        self._reloads = reloads
        self._adopt_parts = adopt
        self._signature = signature
        self._pending: asyncio.Task[None] | None = None

    async def watch(self, stopping: asyncio.Event) -> None:
        """Reload whenever the file changes, until the picker stops."""
        await watch_file(self.config_path, self._signature, stopping, self.reload)

    def reload(self) -> bool:
        """Apply the config file if it is valid; keep the running config otherwise."""
        try:
            config, text = _read_config(self.config_path)
        except ConfigError as exc:
            log.error("config reload refused, keeping the running config: %s", exc)
            self._status("refused", str(exc))
            return False
        applied = self.apply(config)
        if applied:
            _keep_last_good(self.state_dir, text)
        return applied

    def apply(self, config: GatewayConfig) -> bool:
        """Adopt a validated config (from the file or a watched resource) without a restart.

        Returns False (and changes nothing) for a change that needs a restart.
        When the change adds a pool or a pod, Envoy is given the union of old
        and new first and the switch happens once Envoy runs it (see the module
        docstring); otherwise the switch is immediate.
        """
        needs_restart = restart_only_changes(self.config, config)
        if needs_restart:
            message = (
                f"{', '.join(needs_restart)}: cannot change while the gateway runs "
                "(restart `igw serve` to apply)"
            )
            log.error("config change refused, keeping the running config: %s", message)
            self._status("refused", message)
            return False
        self.cancel_pending()
        self._status("applied", f"pools: {', '.join(s.name for s in config.schedulers)}")
        added = self._added_members(config)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if not added or loop is None:
            self._adopt(config)
            return True
        union = union_config(self.config, config)
        for name, addresses in added.items():
            pool = self._datastore.pools.get(name)
            current = pool.members() if pool is not None else []
            write_endpoints(self._eds_dir, cluster_name(name), [*current, *addresses])
        _, rds_version = write_dynamic(union, self.state_dir)
        members = {cluster_name(n): _resolved(a) for n, a in added.items()}
        self._pending = loop.create_task(
            self._adopt_when_applied(config, rds_version, members), name="igw-config-apply"
        )
        return True

    def cancel_pending(self) -> None:
        """Drop a switch still waiting for Envoy (a newer config, or the picker stopping)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _status(self, result: str, message: str) -> None:
        """Count the outcome and leave it in STATE_DIR/reload-status.json for operators."""
        self._reloads.labels(result).inc()
        status = {"result": result, "message": message, "config": str(self.config_path)}
        with contextlib.suppress(OSError):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.state_dir / RELOAD_STATUS_FILE, json.dumps(status).encode())

    def _added_members(self, config: GatewayConfig) -> dict[str, list[str]]:
        """Pools (name → new static endpoints) that the new config adds or grows."""
        added: dict[str, list[str]] = {}
        for sched in config.schedulers:
            pool = self._datastore.pools.get(sched.name)
            if pool is None:
                added[sched.name] = list(sched.endpoints)
            elif sched.endpoints:
                new = [a for a in sched.endpoints if a not in pool.pods]
                if new:
                    added[sched.name] = new
        return added

    async def _adopt_when_applied(
        self, config: GatewayConfig, rds_version: str, members: dict[str, list[str]]
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        ok = await self._envoy.wait_applied(rds_version, members, ENVOY_APPLY_TIMEOUT_S)
        if not ok:
            log.warning(
                "Envoy did not confirm the new routes/members within %.0fs; switching anyway",
                ENVOY_APPLY_TIMEOUT_S,
            )
        self._pending = None
        self._adopt(config)
        log.info("config switch after Envoy applied it in %.2fs", loop.time() - started)

    def _adopt(self, config: GatewayConfig) -> None:
        self.config = config
        self._adopt_parts(config)


def _keep_last_good(state_dir: Path, text: bytes) -> None:
    with contextlib.suppress(OSError):
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(last_good_path(state_dir), text)


def _read_config(path: Path) -> tuple[GatewayConfig, bytes]:
    """The parsed config and the exact bytes it came from (what is kept as last good)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return load_config_text(data.decode("utf-8", "replace")), data


async def watch_file(path: Path, signature: Signature, stopping: asyncio.Event,
                     on_change: Callable[[], object]) -> None:
    """Call `on_change` whenever the file's signature moves from `signature` (polled
    every RELOAD_POLL_S: a ConfigMap swaps the file, no inotify event says so), until
    `stopping` is set. The picker's and the global router's config watch."""
    while not stopping.is_set():
        await asyncio.sleep(RELOAD_POLL_S)
        current = file_signature(path)
        if current != signature:
            signature = current
            on_change()


def file_signature(path: Path) -> Signature:
    """The file's `Signature` (inode too: a ConfigMap swaps the file); zeros if unreadable."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    return (0, 0, 0)


def _resolved(addresses: list[str]) -> list[str]:
    try:
        return [ip for ip, _ in resolve_endpoints(addresses)]
    except EndpointError:
        return []


def union_config(old: GatewayConfig, new: GatewayConfig) -> GatewayConfig:
    """`new` plus the pools only `old` has: what Envoy must route while the picker switches.

    Used only to render clusters and routes (never validated as a config: a
    model may appear in two pools while it moves from one to the other).
    """
    names = {s.name for s in new.schedulers}
    extra = tuple(s for s in old.schedulers if s.name not in names)
    return dataclasses.replace(new, schedulers=new.schedulers + extra)


def restart_only_changes(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The config fields that differ and cannot change without a restart."""
    checks = {
        **listener_changes(old, new),
        "spec.ports": (old.picker_port, old.admin_port, old.metrics_port, old.envoy_admin_port)
        != (new.picker_port, new.admin_port, new.metrics_port, new.envoy_admin_port),
        # The replica's Redis connection, identity and stream position are set up once.
        "spec.coordination": _coordination_of(old) != _coordination_of(new),
    }
    return [name for name, changed in checks.items() if changed]


def listener_changes(old: Any, new: Any) -> dict[str, bool]:
    """What Envoy's listener is rendered from, in a Tier-1 or a global router config:
    whether each part changed (only a restart of Envoy applies it)."""
    return {
        "spec.listener": (old.listen_address, old.listen_port)
        != (new.listen_address, new.listen_port),
        "spec.failureMode": old.failure_mode != new.failure_mode,
        "spec.bbr.maxRequestBodyBytes": old.bbr.max_request_body_bytes
        != new.bbr.max_request_body_bytes,
        "spec.tls": old.tls != new.tls,
        "spec.auth": old.jwt != new.jwt,
        # On or off changes the listener (the identity attributes ext_proc reads, the
        # JWT claim header); the limiter's failure mode is set when it starts.
        "spec.tenants": _tenancy_of(old) != _tenancy_of(new),
    }


def _tenancy_of(config: Any) -> tuple[str | None, str] | None:
    """What only a restart changes of spec.tenants: on/off, the JWT claim, the failure mode
    (the keys file, the tenant list, weights and limits reload)."""
    if config.tenants is None:
        return None
    return (config.tenants.jwt_claim, config.tenants.failure_mode)


def _coordination_of(config: GatewayConfig) -> tuple[object, str] | None:
    """What the coordination link is made of: its settings and the key prefix it uses."""
    if config.coordination is None:
        return None
    return (config.coordination, config.coordination_prefix)
