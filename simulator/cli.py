"""Command line: serve a simulated fleet until SIGTERM/SIGINT.

    python -m simulator --fleet fleet.yaml [--control-port 9000]
    python -m simulator --gpu h100,h100,a10g --model llama-3.1-8b --port-base 8000

Prints ``simulator ready: N pods`` on stdout once every listener is up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import signal
import sys

from simulator import clock
from simulator.fleet import Fleet
from simulator.server import PodServer
from simulator.spec import (
    DEFAULT_HOST,
    ENGINES,
    FleetSpec,
    SpecError,
    load_fleet,
    parse_fleet,
    short_form,
)

EXIT_CRASHED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--fleet", help="fleet spec YAML file")
    src.add_argument("--gpu", help="short form: comma-separated GPU per pod, e.g. h100,a10g")
    p.add_argument("--model", default="llama-3.1-8b", help="short form: served model name")
    p.add_argument("--port-base", type=int, default=8000,
                   help="short form: first pod's port, the others follow (0: free ports)")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="short form: engine")
    p.add_argument("--lora", default="", help="short form: comma-separated adapter names")
    p.add_argument("--max-loras", type=int, default=1, help="short form: resident adapters")
    p.add_argument("--seed", type=int, help="overrides the spec's seed")
    p.add_argument("--time-scale", type=float, help="overrides the spec's time_scale (>= 1)")
    p.add_argument("--control-port", type=int,
                   help="serve the fleet control API on this port (0: a free port)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="default listen address of pods (and of the control port)")
    return p


def load_spec(args: argparse.Namespace) -> FleetSpec:
    if args.fleet:
        spec = load_fleet(args.fleet, default_host=args.host)
    else:
        gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
        loras = [a.strip() for a in args.lora.split(",") if a.strip()]
        spec = parse_fleet(short_form(gpus, args.model, args.port_base, args.engine, loras,
                                      args.max_loras), default_host=args.host)
    overrides: dict[str, object] = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.time_scale is not None:
        if args.time_scale < 1.0:
            raise SpecError("--time-scale must be >= 1")
        overrides["time_scale"] = args.time_scale
    return dataclasses.replace(spec, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args)
    except (SpecError, OSError) as e:
        print(f"simulator: {e}", file=sys.stderr)
        return EXIT_USAGE
    return clock.run(serve(spec, args.control_port, args.host))


async def serve(spec: FleetSpec, control_port: int | None, host: str) -> int:
    """Run the fleet until a signal (exit 0) or, for a lone pod without a control port, until
    it crashes (exit 1: a container's restart policy then plays the part of a restart)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0
    exit_on_crash = len(spec.pods) == 1 and control_port is None

    def on_crash(_pod: PodServer) -> None:
        nonlocal exit_code
        if exit_on_crash:
            exit_code = EXIT_CRASHED
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fleet = Fleet(spec, control_port=control_port, control_host=host, on_crash=on_crash)
    try:
        await fleet.start()
    except OSError as e:
        print(f"simulator: cannot listen: {e}", file=sys.stderr)
        return EXIT_CRASHED
    for pod in fleet.pods.values():
        state = "up" if pod.up else "crashed"
        print(f"{pod.name} {pod.spec.engine} {pod.spec.gpu} {pod.spec.model} {pod.url} {state}",
              file=sys.stderr)
    if fleet.control_url:
        print(f"control {fleet.control_url}", file=sys.stderr)
    gc.freeze()  # start-up objects leave the collector's view: shorter pauses while serving
    print(f"simulator ready: {len(fleet.pods)} pods", flush=True)
    await stop.wait()
    await fleet.stop()
    return exit_code
