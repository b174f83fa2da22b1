"""Envoy side of the inference gateway: bootstrap rendering, EDS/SDS files, TLS, process.

Public API:
    render_bootstrap(config, paths) -> dict         pure rendering
    write_bootstrap(config, state_dir, ...) -> Path envoy.yaml + TLS + SDS + EDS files
    render_yaml(config, state_dir, ...) -> str      what `igw render-envoy` prints
    write_endpoints(eds_dir, cluster_name, addresses)  pool membership for Envoy
    ensure_self_signed(state_dir, hosts) -> TlsFiles  (clients trust TlsFiles.ca_cert)
    generated_files(state_dir) -> TlsFiles           where the generated files live
    find_envoy(), validate_config(path), EnvoyProcess
"""

from typing import TYPE_CHECKING

from igw_envoy.binary import (
    EnvoyConfigError,
    EnvoyNotFoundError,
    envoy_command,
    find_envoy,
    validate_config,
)
from igw_envoy.eds import cluster_name, eds_path, read_endpoints, write_endpoints
from igw_envoy.process import EnvoyProcess, EnvoyStartError
from igw_envoy.sds import write_secret
from igw_envoy.tls import TlsFiles, ensure_self_signed, generated_files

if TYPE_CHECKING:
    from igw_envoy.render import (
        RenderPaths,
        default_paths,
        render_bootstrap,
        render_yaml,
        write_bootstrap,
    )

# igw_envoy.render is imported on first use, not here: `python -m
# igw_envoy.render` must not find the module already imported by its package.
_RENDER_NAMES = (
    "RenderPaths",
    "default_paths",
    "render_bootstrap",
    "render_yaml",
    "write_bootstrap",
)


def __getattr__(name: str) -> object:
    if name in _RENDER_NAMES:
        from igw_envoy import render

        return getattr(render, name)
    raise AttributeError(f"module 'igw_envoy' has no attribute {name!r}")


__all__ = [
    "EnvoyConfigError",
    "EnvoyNotFoundError",
    "EnvoyProcess",
    "EnvoyStartError",
    "RenderPaths",
    "TlsFiles",
    "cluster_name",
    "default_paths",
    "eds_path",
    "ensure_self_signed",
    "envoy_command",
    "find_envoy",
    "generated_files",
    "read_endpoints",
    "render_bootstrap",
    "render_yaml",
    "validate_config",
    "write_bootstrap",
    "write_endpoints",
    "write_secret",
]
