"""Pool clusters (CDS) and routes (RDS) as watched files, so pools change without a restart.

The bootstrap keeps what never changes while the gateway runs (the listener,
the picker cluster, the JWKS cluster); the parts a config reload changes are
two files Envoy watches, each a `DiscoveryResponse` replaced atomically:

    STATE_DIR/cds/clusters.json   every pool cluster (members from eds/<cluster>.json)
    STATE_DIR/rds/routes.json     the route configuration `gateway`

Envoy applies a new CDS file cluster by cluster (an unchanged cluster is kept
as it is, connections and all; a new one warms from its EDS file before it is
used) and a new RDS file atomically for new requests, so a reload drops nothing.
`version_info` is a hash of the content: Envoy's admin `/config_dump` shows
which version it runs (the picker waits for it before it sends requests to a
new pool, see picker.envoy_admin).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from contract.config import GatewayConfig
from igw_envoy.atomic import write_atomic
from igw_envoy.clusters import pool_cluster
from igw_envoy.eds import cluster_name
from igw_envoy.routes import route_config

CDS_SUBDIR = "cds"
RDS_SUBDIR = "rds"
CDS_FILE = "clusters.json"
RDS_FILE = "routes.json"
ROUTE_CONFIG_NAME = "gateway"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_CONFIG_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def cds_path(state_dir: Path) -> Path:
    return Path(state_dir) / CDS_SUBDIR / CDS_FILE


def rds_path(state_dir: Path) -> Path:
    return Path(state_dir) / RDS_SUBDIR / RDS_FILE


def _file_source(path: Path) -> dict:
    path = Path(path).resolve()
    return {
        "path_config_source": {"path": str(path), "watched_directory": {"path": str(path.parent)}},
        "resource_api_version": "V3",
    }


def cds_config(state_dir: Path) -> dict:
    """The bootstrap's `dynamic_resources` block: clusters from the watched CDS file."""
    return {"cds_config": _file_source(cds_path(state_dir))}


def rds_config(state_dir: Path) -> dict:
    """The connection manager's `rds` block: routes from the watched RDS file."""
    return {
        "route_config_name": ROUTE_CONFIG_NAME,
        "config_source": _file_source(rds_path(state_dir)),
    }


def pool_clusters(config: GatewayConfig, eds_dir: Path) -> list[dict]:
    limit = config.bbr.max_request_body_bytes
    return [
        pool_cluster(cluster_name(s.name), eds_dir, limit, config.max_fallbacks)
        for s in config.schedulers
    ]


def _document(resources: list[dict], type_url: str) -> tuple[bytes, str]:
    typed = [{"@type": type_url, **r} for r in resources]
    body = json.dumps(typed, sort_keys=True).encode()
    version = hashlib.sha256(body).hexdigest()[:16]
    document = {"version_info": version, "resources": typed}
    return json.dumps(document, indent=1, sort_keys=True).encode(), version


def dynamic_documents(config: GatewayConfig, eds_dir: Path) -> tuple[bytes, bytes, str, str]:
    """(CDS file, RDS file, CDS version, RDS version) for a config; writes nothing."""
    cds, cds_version = _document(pool_clusters(config, eds_dir), CLUSTER_TYPE)
    rds, rds_version = _document([route_config(config)], ROUTE_CONFIG_TYPE)
    return cds, rds, cds_version, rds_version


def write_dynamic(config: GatewayConfig, state_dir: Path) -> tuple[str, str]:
    """Write the CDS file, then the RDS file (clusters first, so a new route never
    names a cluster Envoy has not seen); returns their versions."""
    state_dir = Path(state_dir)
    cds, rds, cds_version, rds_version = dynamic_documents(config, state_dir / "eds")
    for path, data in ((cds_path(state_dir), cds), (rds_path(state_dir), rds)):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            write_atomic(path, data)
    return cds_version, rds_version


def written_versions(state_dir: Path) -> tuple[str | None, str | None]:
    """The versions currently in the CDS and RDS files (None for a missing file)."""
    out: list[str | None] = []
    for path in (cds_path(state_dir), rds_path(state_dir)):
        try:
            out.append(json.loads(path.read_text()).get("version_info"))
        except (OSError, ValueError):
            out.append(None)
    return out[0], out[1]
