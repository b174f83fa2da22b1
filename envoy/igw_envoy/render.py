"""Render the Envoy bootstrap for a `GatewayConfig`, and the files it reads.

`render_bootstrap` is pure (config + paths → dict). `write_bootstrap` also
creates what the bootstrap points at: the listener certificate (generated
when `spec.tls` names none), its SDS file, and each pool's first EDS file
from the static `endpoints`, so Envoy has members before the picker runs.

    python -m igw_envoy.render CONFIG STATE_DIR   # prints the YAML
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from contract.config import ConfigError, GatewayConfig, load_config
from contract.global_config import GlobalRouterConfig
from igw_envoy.binary import validate_config
from igw_envoy.clusters import picker_cluster, picker_http_cluster
from igw_envoy.eds import cluster_name, eds_path, write_endpoints
from igw_envoy.jwt import jwks_cluster
from igw_envoy.listener import ListenerInputs, listener
from igw_envoy.sds import write_secret
from igw_envoy.tls import TlsFiles, ensure_self_signed, generated_files, reload_dir
from igw_envoy.xds import cds_config, pool_clusters, write_dynamic, written_versions

log = logging.getLogger(__name__)

BOOTSTRAP_NAME = "envoy.yaml"
DOWNSTREAM_CONNECTIONS_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)
MAX_DOWNSTREAM_CONNECTIONS = 50_000
_ANY_ADDRESS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class RenderPaths:
    """Where the bootstrap's files live, and where Envoy finds the picker and logs."""

    state_dir: Path
    cert: Path
    key: Path
    picker_address: str
    access_log: str | None = None  # None: stdout
    jwt_base_dir: Path | None = None  # relative jwksFile paths are resolved against it

    @property
    def eds_dir(self) -> Path:
        return self.state_dir / "eds"

    @property
    def sds_dir(self) -> Path:
        return self.state_dir / "sds"

    @property
    def bootstrap(self) -> Path:
        return self.state_dir / BOOTSTRAP_NAME


def default_paths(
    config: GatewayConfig | GlobalRouterConfig,
    state_dir: Path,
    *,
    access_log: str | None = None,
    picker_address: str | None = None,
    jwt_base_dir: Path | None = None,
) -> RenderPaths:
    """Paths for a state dir: the user's certificate files, or the generated ones."""
    state_dir = Path(state_dir).resolve()
    if config.tls.certificate_file and config.tls.key_file:
        cert, key = Path(config.tls.certificate_file), Path(config.tls.key_file)
    else:
        generated = generated_files(state_dir)
        cert, key = generated.cert, generated.key
    return RenderPaths(
        state_dir=state_dir,
        cert=cert.resolve(),
        key=key.resolve(),
        picker_address=picker_address or f"127.0.0.1:{config.picker_port}",
        access_log=access_log,
        jwt_base_dir=jwt_base_dir,
    )


def render_bootstrap(config: GatewayConfig, paths: RenderPaths, *, dynamic: bool = False) -> dict:
    """The whole Envoy bootstrap as a dict (no file is touched).

    `dynamic=False` inlines the pool clusters and the routes: one self-contained
    document (what `igw render-envoy` prints and `envoy --mode validate` checks).
    `dynamic=True` is what `write_bootstrap` runs: pool clusters and routes come
    from the watched CDS and RDS files (igw_envoy.xds), so a config reload can
    add or remove pools without restarting Envoy.
    """
    picker_host, _, picker_port = paths.picker_address.rpartition(":")
    picker_host = picker_host.strip("[]")
    clusters = [
        picker_cluster(picker_host, int(picker_port)),
        picker_http_cluster(picker_host, config.metrics_port),
    ]
    if not dynamic:
        clusters += pool_clusters(config, paths.eds_dir)
    if config.jwt is not None and config.jwt.jwks_uri:
        clusters.append(jwks_cluster(config.jwt.jwks_uri))
    inputs = ListenerInputs(
        paths.sds_dir,
        paths.access_log,
        paths.jwt_base_dir,
        rds_state_dir=paths.state_dir if dynamic else None,
    )
    node_name = f"igw-{config.name}"
    bootstrap: dict = {
        "node": {"id": node_name, "cluster": node_name},
        "admin": {
            "address": {
                "socket_address": {"address": "127.0.0.1", "port_value": config.envoy_admin_port}
            }
        },
        "static_resources": {"listeners": [listener(config, inputs)], "clusters": clusters},
        "overload_manager": overload_manager(),
    }
    if dynamic:
        bootstrap["dynamic_resources"] = cds_config(paths.state_dir)
    return bootstrap


def overload_manager() -> dict:
    """A ceiling on open client connections: beyond it Envoy refuses, instead of running
    out of file descriptors (and it silences Envoy's startup warning about the missing limit)."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": DOWNSTREAM_CONNECTIONS_TYPE,
                    "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS,
                },
            }
        ]
    }


def render_yaml(
    config: GatewayConfig,
    state_dir: Path,
    *,
    access_log: str | None = None,
    picker_address: str | None = None,
) -> str:
    """The bootstrap as YAML for a state dir (what `igw render-envoy` prints); writes nothing."""
    paths = default_paths(config, state_dir, access_log=access_log, picker_address=picker_address)
    return to_yaml(render_bootstrap(config, paths))


def to_yaml(bootstrap: dict) -> str:
    return yaml.safe_dump(bootstrap, sort_keys=False, default_flow_style=False)


def write_bootstrap(
    config: GatewayConfig,
    state_dir: Path,
    *,
    access_log: str | None = None,
    picker_address: str | None = None,
    jwt_base_dir: Path | None = None,
    validate: bool = False,
    dynamic_files: bool = True,
) -> Path:
    """Write envoy.yaml and the files it reads into `state_dir`; returns envoy.yaml's path.

    Creates the self-signed certificate when `spec.tls` names no files, the
    SDS file pointing at the certificate, each pool's EDS file (from its
    static endpoints; a pool without them gets an empty file only if it has
    none yet, so membership the picker wrote survives a re-render), and the
    CDS and RDS files (igw_envoy.xds). `dynamic_files=False` leaves CDS/RDS
    files that already exist alone: once the picker runs it owns them (it
    rewrites them on every config reload), and an Envoy restart must come back
    with the pools the picker serves, not with the file's first version.
    """
    paths = default_paths(
        config,
        state_dir,
        access_log=access_log,
        picker_address=picker_address,
        jwt_base_dir=jwt_base_dir,
    )
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    tls_files = ensure_certificate(config, paths)
    watched = reload_dir(tls_files.cert.parent) if tls_files.ca_cert is not None else None
    write_secret(paths.sds_dir, paths.cert, paths.key, watched_dir=watched)
    for sched in config.schedulers:
        name = cluster_name(sched.name)
        if sched.endpoints or not eds_path(paths.eds_dir, name).exists():
            write_endpoints(paths.eds_dir, name, sched.endpoints)
    if dynamic_files or None in written_versions(paths.state_dir):
        write_dynamic(config, paths.state_dir)
    paths.bootstrap.write_text(to_yaml(render_bootstrap(config, paths, dynamic=True)))
    if validate:
        validate_config(paths.bootstrap)
        # Validate mode does not read xDS files: check clusters and routes inline too.
        inline = paths.state_dir / "envoy.validate.yaml"
        inline.write_text(to_yaml(render_bootstrap(config, paths)))
        try:
            validate_config(inline)
        finally:
            inline.unlink(missing_ok=True)
    return paths.bootstrap


def certificate_hosts(config: GatewayConfig | GlobalRouterConfig) -> tuple[str, ...]:
    """Names the generated certificate covers: loopback, the listen address, this host."""
    hosts = ["localhost", "127.0.0.1", "::1"]
    if config.listen_address not in _ANY_ADDRESS:
        hosts.append(config.listen_address)
    hostname = socket.gethostname()
    if hostname:
        hosts.append(hostname)
    return tuple(dict.fromkeys(hosts))


def ensure_certificate(config: GatewayConfig | GlobalRouterConfig, paths: RenderPaths
                       ) -> TlsFiles:
    """The listener's certificate: the configured files, else a generated self-signed one."""
    if config.tls.certificate_file and config.tls.key_file:
        for path in (paths.cert, paths.key):
            if not path.is_file():
                raise ConfigError(f"spec.tls: {path} does not exist")
        return TlsFiles(ca_cert=None, cert=paths.cert, key=paths.key)
    if config.tls.secret_name:
        log.warning(
            "spec.tls.secretName=%s cannot be read outside Kubernetes; "
            "using a generated certificate (give certificateFile/keyFile instead)",
            config.tls.secret_name,
        )
    return ensure_self_signed(paths.state_dir, certificate_hosts(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m igw_envoy.render", description="Print the Envoy bootstrap for a config."
    )
    parser.add_argument("config", help="InferenceGatewayConfig file")
    parser.add_argument("state_dir", help="directory for certificates, EDS and SDS files")
    parser.add_argument(
        "--write",
        action="store_true",
        help="also write envoy.yaml, certificates, SDS and EDS files into STATE_DIR",
    )
    parser.add_argument("--access-log", default=None, help="access log file (default stdout)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.write:
            path = write_bootstrap(config, Path(args.state_dir), access_log=args.access_log)
            print(path.read_text(), end="")
        else:
            print(render_yaml(config, Path(args.state_dir), access_log=args.access_log), end="")
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
