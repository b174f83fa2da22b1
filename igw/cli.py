"""The `igw` command: run the gateway, a simulated fleet, benchmarks, and admin calls."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from pathlib import Path

from contract.config import ConfigError, GatewayConfig, load_config

# The config model's defaults, so a flag's default never disagrees with the file's.
_DEFAULTS = GatewayConfig(schedulers=())
ADMIN_DEFAULT = f"127.0.0.1:{_DEFAULTS.admin_port}"


def _load(path: Path) -> GatewayConfig | None:
    """The config, or None after printing its one-line error."""
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return None


def _cmd_validate(args: argparse.Namespace) -> int:
    config = _load(args.file)
    if config is None:
        return 1
    pools = ", ".join(f"{s.name} ({s.model_name})" for s in config.schedulers)
    print(f"{args.file}: valid; pools: {pools}")
    return 0


def _cmd_render_envoy(args: argparse.Namespace) -> int:
    from igw_envoy.render import render_yaml

    config = _load(args.file)
    if config is None:
        return 1
    print(render_yaml(config, args.state_dir))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from igw.gateway import serve

    if _load(args.config) is None:
        return 1
    return asyncio.run(serve(args.config, args.state_dir, args.port, args.drain_timeout))


def _cmd_up(args: argparse.Namespace) -> int:
    from igw.gateway import up

    return asyncio.run(up(args.state_dir, args.port))


def _cmd_global_serve(args: argparse.Namespace) -> int:
    from contract.global_config import load_global_config
    from igw.global_gateway import serve_global

    try:
        load_global_config(args.config)
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(serve_global(args.config, args.state_dir, args.port, args.drain_timeout))


def _cmd_global_up(args: argparse.Namespace) -> int:
    from igw.global_gateway import up_global

    return asyncio.run(up_global(args.state_dir, args.port))


def _cmd_global_status(args: argparse.Namespace) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://{args.http}/regions", timeout=5) as reply:
        doc = json.loads(reply.read())
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for r in doc["regions"]:
        print(region_line(r))
    return 0


def region_line(r: dict) -> str:
    """One region of `igw global status`: its state, RTT and pools."""
    state = "fresh" if r["fresh"] else f"UNKNOWN ({r['error'] or 'stale'})"
    models = ", ".join(
        f"{p['model']} ready={p['readyPods']}/{p['pods']} ttft={p['predictedTtftS']}"
        for p in r["pools"]
    )
    # suspect: its poll is overdue or its last one failed or was slow (placed last)
    marks = "".join(f" {m}" for m in ("drained", "suspect") if r.get(m))
    return f"{r['name']:<12} {state}{marks} rtt={r['rttS'] * 1000:.1f}ms  {models}"


def _add_global_parser(sub: argparse._SubParsersAction, state_dir: Path) -> None:
    """`igw global serve|up|status`: the Tier-2 router (docs/global.md)."""
    group = sub.add_parser("global", help="the global router across regions (Tier 2)")
    commands = group.add_subparsers(dest="global_command", required=True)
    p = commands.add_parser("serve", help="run the global router + its Envoy for a config")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--port", type=int, default=None, help="override spec.listener.port")
    p.add_argument("--state-dir", type=Path, default=state_dir / "global")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.set_defaults(func=_cmd_global_serve)
    p = commands.add_parser("up", help="global router + three simulated regions (demo)")
    p.add_argument("--port", type=int, default=_DEFAULTS.listen_port)
    p.add_argument("--state-dir", type=Path, default=state_dir / "global-up")
    p.set_defaults(func=_cmd_global_up)
    p = commands.add_parser("status", help="what the global router knows of each region")
    p.add_argument("--http", default="127.0.0.1:9092", help="the router's HTTP host:port")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_global_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from igw.admin_client import format_status, status

    doc = status(args.admin)
    pools = doc["pools"]
    text = None if args.json else format_status(pools, doc["coordination"], doc["tenants"])
    print(json.dumps(pools, indent=2) if args.json else text)
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from igw.admin_client import explain, explain_body

    body = Path(args.body).read_bytes() if args.body else explain_body(args.model, args.prompt)
    print(json.dumps(explain(args.admin, body, args.path), indent=2))
    return 0


def _cmd_drain(args: argparse.Namespace, drain: bool) -> int:
    from igw.admin_client import set_drain

    changed = set_drain(args.admin, args.pool, args.address, drain)
    print(
        f"{args.address}: {'drained' if drain else 'undrained'}{'' if changed else ' (no change)'}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from igw.paths import default_state_dir

    parser = argparse.ArgumentParser(prog="igw", description="GPU-aware LLM inference gateway")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="gateway + simulated mixed-GPU fleet on an embedded config")
    p.add_argument("--port", type=int, default=_DEFAULTS.listen_port)
    p.add_argument("--state-dir", type=Path, default=default_state_dir() / "up")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("serve", help="run Envoy + the picker for a config file")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--port", type=int, default=None, help="override spec.listener.port")
    p.add_argument("--state-dir", type=Path, default=default_state_dir() / "serve")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds in-flight requests may take to finish (default 30)",
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("validate", help="check a config file")
    p.add_argument("file", type=Path)
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("render-envoy", help="print the Envoy bootstrap for a config")
    p.add_argument("file", type=Path)
    p.add_argument("--state-dir", type=Path, default=default_state_dir() / "serve")
    p.set_defaults(func=_cmd_render_envoy)

    # Listed for --help; `main` hands their arguments to the module untouched.
    sub.add_parser("sim", help="run a simulated model-server fleet (igw sim --help)")
    sub.add_parser("bench", help="routing benchmarks (igw bench --help)")

    for name, func in (("status", _cmd_status), ("explain", _cmd_explain)):
        p = sub.add_parser(name, help=f"admin: {name}")
        p.add_argument("--admin", default=ADMIN_DEFAULT, help="picker admin address host:port")
        p.set_defaults(func=func)
        if name == "status":
            p.add_argument("--json", action="store_true")
        else:
            p.add_argument("--model")
            p.add_argument("--prompt", default="hello")
            p.add_argument("--body", help="file holding a full request body")
            p.add_argument("--path", default="/v1/chat/completions")

    _add_global_parser(sub, default_state_dir())

    from igw.tenant_keys import add_parser as add_tenants_parser

    add_tenants_parser(sub)

    for name, drain in (("drain", True), ("undrain", False)):
        p = sub.add_parser(name, help=f"admin: {name} a pod")
        p.add_argument("pool")
        p.add_argument("address")
        p.add_argument("--admin", default=ADMIN_DEFAULT)
        p.set_defaults(func=lambda a, d=drain: _cmd_drain(a, d))
    return parser


# Subcommands that own their whole command line (argparse's REMAINDER would
# refuse a leading option such as `igw sim --gpu ...`).
_PASSTHROUGH = {"sim": "simulator.cli", "bench": "bench.cli"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _PASSTHROUGH:
        module = importlib.import_module(_PASSTHROUGH[argv[0]])
        return module.main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
