"""The listener certificate as a file-based SDS secret, so it reloads without a restart.

The listener names a secret (`server_cert`) whose source is a watched file
(`path_config_source` + `watched_directory`). That file does not inline the
PEM; it points at the certificate and key files. Envoy watches the parent
directories of those files for renames (default `TlsCertificate` behaviour for
SDS-delivered secrets with file references) and re-reads the pair, checking
that certificate and key were read consistently. So rotating the certificate
is: replace the key and certificate files by rename (what a Kubernetes
secret mount does with its `..data` symlink swap), no restart, no config
change. The generated certificate is watched through `tls/reload` instead,
which `tls.py` touches once both files are in place. Pointing the secret at different files is a
rewrite of the SDS file, also picked up live.
"""

from __future__ import annotations

import json
from pathlib import Path

from igw_envoy.atomic import write_atomic

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
SERVER_SECRET = "server_cert"


def sds_path(sds_dir: Path, name: str = SERVER_SECRET) -> Path:
    return Path(sds_dir) / f"{name}.json"


def secret_resource(name: str, cert: Path, key: Path, watched_dir: Path | None = None) -> dict:
    """A `Secret` holding a TlsCertificate by file reference (absolute paths).

    `watched_dir`, when given, is the only directory whose renames trigger a
    reload (otherwise Envoy watches the certificate's and key's own
    directories).
    """
    tls_certificate: dict = {
        "certificate_chain": {"filename": str(Path(cert).resolve())},
        "private_key": {"filename": str(Path(key).resolve())},
    }
    if watched_dir is not None:
        tls_certificate["watched_directory"] = {"path": str(Path(watched_dir).resolve())}
    return {"@type": SECRET_TYPE, "name": name, "tls_certificate": tls_certificate}


def write_secret(
    sds_dir: Path,
    cert: Path,
    key: Path,
    name: str = SERVER_SECRET,
    watched_dir: Path | None = None,
) -> Path:
    """Write (atomically) the SDS file for the listener certificate; returns its path."""
    sds_dir = Path(sds_dir)
    sds_dir.mkdir(parents=True, exist_ok=True)
    path = sds_path(sds_dir, name)
    document = {"resources": [secret_resource(name, cert, key, watched_dir)]}
    write_atomic(path, json.dumps(document, indent=1).encode())
    return path


def sds_config(sds_dir: Path, name: str = SERVER_SECRET) -> dict:
    """The `SdsSecretConfig` a TLS context uses to read the secret from its watched file."""
    sds_dir = Path(sds_dir).resolve()
    return {
        "name": name,
        "sds_config": {
            "path_config_source": {
                "path": str(sds_path(sds_dir, name)),
                "watched_directory": {"path": str(sds_dir)},
            },
            "resource_api_version": "V3",
        },
    }
