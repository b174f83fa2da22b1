"""What the global tier adds per request, next to what Tier 1 itself costs.

    igw bench --global-overhead [--duration 8]   (or: python -m bench.global_overhead [--rounds 4])

Five paths, wrk (bench.overhead's 1 KB non-streaming chat body) against each:

    echo            bench/echo_server.py (a one-token answer that costs nothing), plaintext
    tier1           a real Tier-1 gateway (`igw serve`, one pool, admission off) -> echo
    standin         bench/standin_region.py: what the global tier sees of a region (an Envoy
                    with Tier 1's listener TLS answering the same one-token answer itself,
                    the load summary) with no gateway behind it
    global-standin  the real global tier (`igw global serve`, one region) -> standin
    global          the real global tier -> the Tier-1 gateway above -> echo (stacked)

Interleaved: each point is `rounds` slices, every path once per round, so a minute of a
noisy machine falls on all of them. Per point and path: latency p50/p99 (the median of
the slices'), requests/s, and CPU per request of each process (Tier-1 picker and Envoy;
global router and its Envoy; the echo server or the stand-in behind them).

The figure #18 asks for, each tier measured the way `igw bench --overhead` measures Tier 1,
in front of a backend that costs (almost) nothing:
- Tier 1's own = tier1 - echo (p50), its picker + Envoy (CPU per request);
- the global tier's own = global-standin - standin (p50), its router + Envoy (CPU).
The baseline for the global tier is the stand-in reached directly over TLS, not the
plaintext echo server: the global tier's hop includes its own TLS to the region (Envoy
encrypting upstream), but the region terminating that TLS and answering is the region's
cost, which the direct TLS run holds. What is left of the stand-in in the difference is
its HTTP/2 (Envoy talks HTTP/2 to regions, wrk HTTP/1.1 to the stand-in) and its colder
wake-ups behind a slower path: the points table shows its CPU per request on both paths
(~0.12 ms against ~0.09 at one connection; a hand-framed Python HTTP/2 stand-in spent
~0.08 against ~0.04), as it shows the echo server's behind Tier 1.
Tier 1's own likewise includes its TLS from the client, as the global tier's does.

The stacked path (kept: it is the deployment's shape) charges the global tier for more
than its hop on this 2-core VM: six busy processes share two cores, and the Tier-1
processes behind the global tier idle longer between requests and answer later (below).

Two kinds of point:
- closed loop at 1 and 8 connections (as `igw bench --overhead`): each path as fast as it
  goes, so a longer path also sends fewer requests a second;
- paced: the same offered rate on every path (1 connection at 100 and 200 requests/s, 8
  at 400; each well below what the global path sustains). On a VM whose idle vCPUs halt
  (this machine's guest halt polling is off), a process woken after a longer idle gap
  answers later: Tier 1's own p50 grows from ~0.9 ms back to back to ~2 ms at 100/s. In the
  closed loop the stacked path runs at about half Tier 1's rate, so its Tier-1 processes
  idle longer per request than in the direct run and the difference of the two p50s
  charges the global tier for Tier 1's slower wake-ups. At one rate each tier's
  processes see the same gaps.

Results: bench/results/global_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.output import utc_stamp, write_results
from bench.overhead import LUA, MODEL, _body, _cpu, _wrk, wrk_threads
from bench.procs import (
    descendants,
    machine_cpu,
    process_name,
    start_child,
    start_piped,
    wait_line,
    wait_log_line,
)
from bench.standin_region import ca_file
from igw.ports import free_ports

RESULTS = Path(__file__).resolve().parent / "results"
CONCURRENCY = (1, 8)
# (connections, requests/s): offered rates well below what the global path sustains closed
PACED = ((1, 100), (1, 200), (8, 400))
WARMUP_S = 1.0  # per point and path, before its slices
HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
# wrk's delay() (LuaJIT): the next send at the next slot of a fixed schedule, so the offered
# rate is RATE whatever the latency (a late answer's slot is skipped, not made up in a burst).
# One schedule per wrk thread, shared by that thread's connections.
PACED_LUA = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } igw_timespec;
int clock_gettime(int clk_id, igw_timespec *tp);
]]
local now_ts = ffi.new("igw_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, now_ts)
  return tonumber(now_ts.tv_sec) * 1000 + tonumber(now_ts.tv_nsec) / 1e6
end
local period_ms = 1000 / RATE
local next_ms = nil
function delay()
  local t = now_ms()
  next_ms = math.max((next_ms or t) + period_ms, t)
  return math.floor(next_ms - t + 0.5)
end
"""
IGW = [sys.executable, "-m", "igw.cli"]


def _tier1_doc(echo_port: int) -> dict[str, Any]:
    listen, picker, admin, metrics, envoy_admin = free_ports(5)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "InferenceGatewayConfig",
        "metadata": {"name": "bench-tier1"},
        "spec": {
            # admission and flow control out of reach, as bench.overhead's `-noadmit`:
            # the figure is the pipeline's cost, not the admission queue's pacing
            "schedulers": [{"name": "echo", "modelName": MODEL,
                            "endpoints": [f"127.0.0.1:{echo_port}"],
                            "saturation": {"queueThreshold": 1_000_000, "kvCacheThreshold": 1.0,
                                           "maxStartDelay": "0s"}}],
            "listener": {"address": "127.0.0.1", "port": listen},
            "ports": {"picker": picker, "admin": admin, "metrics": metrics,
                      "envoyAdmin": envoy_admin},
        },
    }


def _global_doc(region: str, port: int, ca: Path) -> dict[str, Any]:
    """The global tier with one region, `region` on 127.0.0.1:`port`, verified with `ca`."""
    listen, picker, metrics, envoy_admin = free_ports(4)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
        "metadata": {"name": f"bench-global-{region}"},
        "spec": {
            "regions": [{"name": region, "endpoint": f"127.0.0.1:{port}",
                         "caFile": str(ca)}],
            "models": [{"name": MODEL, "policy": "fastest"}],
            "listener": {"address": "127.0.0.1", "port": listen},
            "ports": {"picker": picker, "metrics": metrics, "envoyAdmin": envoy_admin},
        },
    }


def _serve(work: Path, name: str, command: list[str], doc: dict[str, Any]):
    state = work / name
    state.mkdir(parents=True, exist_ok=True)
    path = state / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    child = start_piped(name, [*IGW, *command, "--config", str(path), "--state-dir", str(state)])
    url = wait_line(child, lambda line: line.startswith("https://"), 90)
    child.drain()
    return child, url, state


def _pids(supervisor_pid: int) -> dict[str, int]:
    """The supervisor's children by what they run (envoy, picker or globalrouter)."""
    out = {}
    for pid in descendants(supervisor_pid):
        name = process_name(pid)
        for key in ("envoy", "globalrouter", "picker"):
            if key in name and key not in out:
                out[key] = pid
    return out


@dataclass(frozen=True)
class Spec:
    """One point: closed loop at `connections`, or paced at `rate` requests/s in all."""

    connections: int
    rate: int | None = None

    @property
    def label(self) -> str:
        if self.rate:
            return f"{self.connections} at {self.rate}/s"
        return f"{self.connections} closed"


def _scripts(work: Path) -> dict[Spec, Path]:
    body = LUA.replace("BODY", _body())
    out = {}
    for spec in [*(Spec(c) for c in CONCURRENCY), *(Spec(c, r) for c, r in PACED)]:
        path = work / f"post-{spec.connections}-{spec.rate or 0}.lua"
        if spec.rate:
            per_thread = spec.rate / wrk_threads(spec.connections)
            path.write_text(body + PACED_LUA.replace("RATE", f"{per_thread:g}"))
        else:
            path.write_text(body)
        out[spec] = path
    return out


def _measure(paths: dict[str, tuple[str, dict[str, int]]], script: Path, spec: Spec,
             seconds: float, rounds: int) -> list[dict[str, Any]]:
    """Every path once per round, `seconds / rounds` each; the slices' p50/p99 medians,
    the CPU and requests of all slices together."""
    for url, _ in paths.values():
        _wrk(url, script, spec.connections, WARMUP_S)
    slices: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    cpu = {name: dict.fromkeys(pids, 0.0) for name, (_, pids) in paths.items()}
    busy = dict.fromkeys(paths, 0.0)  # the whole machine's busy CPU seconds
    for _ in range(rounds):
        for name, (url, pids) in paths.items():
            before, machine = _cpu(pids), machine_cpu()[0]
            slices[name].append(_wrk(url, script, spec.connections, seconds / rounds))
            after = _cpu(pids)
            busy[name] += machine_cpu()[0] - machine
            for key in pids:
                cpu[name][key] += after[key] - before[key]
    points = []
    for name, runs in slices.items():
        requests = max(sum(r["requests"] for r in runs), 1)
        wall = sum(r["duration_us"] for r in runs) / 1e6
        points.append({
            "path": name, "connections": spec.connections, "rate": spec.rate,
            "requests": requests,
            "errors": sum(r["errors"] + r["status_errors"] for r in runs),
            "p50_us": statistics.median(r["p50_us"] for r in runs),
            "p99_us": statistics.median(r["p99_us"] for r in runs),
            "slice_p50_us": [r["p50_us"] for r in runs],
            "rps": requests / wall,
            "cpu_ms_per_request": {k: 1000 * v / requests for k, v in cpu[name].items()},
            # cores kept busy by anything but the path's processes and wrk: another
            # process on this shared machine, the idle paths' polls, unattributed kernel
            # work (softirq)
            "background_cores": (busy[name] - sum(cpu[name].values())
                                 - sum(r["wrk_cpu_s"] for r in runs)) / wall,
        })
    return points


def _cpu_of(point: dict[str, Any], prefix: str) -> float:
    """CPU ms per request of the processes whose name starts with `prefix`."""
    return sum(v for k, v in point["cpu_ms_per_request"].items() if k.startswith(prefix))


def _summary(points: list[dict[str, Any]], spec: Spec) -> dict[str, Any]:
    by = {p["path"]: p for p in points
          if p["connections"] == spec.connections and p["rate"] == spec.rate}
    row = {
        "point": spec.label, "connections": spec.connections, "rate": spec.rate,
        # Tier 1's own: its gateway in front of the echo server, less the echo server
        "tier1_p50_ms": (by["tier1"]["p50_us"] - by["echo"]["p50_us"]) / 1000,
        "tier1_cpu_ms": _cpu_of(by["tier1"], "tier1-"),
        # the global tier's own: in front of the stand-in region, less the stand-in
        "own_p50_ms": (by["global-standin"]["p50_us"] - by["standin"]["p50_us"]) / 1000,
        "own_cpu_ms": _cpu_of(by["global-standin"], "global-"),
        # stacked: in front of the real Tier 1, less Tier 1 reached directly
        "added_p50_ms": (by["global"]["p50_us"] - by["tier1"]["p50_us"]) / 1000,
        "global_cpu_ms": _cpu_of(by["global"], "global-"),
    }
    row["own_within"] = (row["own_p50_ms"] <= row["tier1_p50_ms"]
                         and row["own_cpu_ms"] <= row["tier1_cpu_ms"])
    row["stacked_within"] = (row["added_p50_ms"] <= row["tier1_p50_ms"]
                             and row["global_cpu_ms"] <= row["tier1_cpu_ms"])
    return row


def _halt_poll() -> str:
    """This VM's guest halt polling (the idle wake-up cost the paced points are about)."""
    try:
        ns = int(HALT_POLL.read_text())
    except (OSError, ValueError):
        return "not a haltpoll guest"
    return f"guest_halt_poll_ns={ns}" + (" (off)" if ns == 0 else "")


def _background(point: dict[str, Any]) -> str:
    cores = point.get("background_cores")
    return "" if cores is None else f"{cores:.2f}"


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# The global tier's extra hop", "",
        f"{doc['date']}, {doc['cores']} cores, load average {doc['load_average']:.1f}, "
        f"{doc['halt_poll']}; `{doc['command']}`; {doc['duration_s']:g} s per point and path "
        f"in {doc['rounds']} interleaved slices, after a {WARMUP_S:g} s warm-up.",
        "", "| point | path | p50 ms | p99 ms | req/s | errors | CPU ms/request "
        "| background cores |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for point in doc["points"]:
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in point["cpu_ms_per_request"].items())
        label = Spec(point["connections"], point["rate"]).label
        lines.append(f"| {label} | {point['path']} | {point['p50_us'] / 1000:.2f} "
                     f"| {point['p99_us'] / 1000:.2f} | {point['rps']:.0f} "
                     f"| {point.get('errors', 0)} | {cpu} "
                     f"| {_background(point)} |")
    lines += ["", "Each tier's own, each in front of a backend that costs (almost) nothing "
              "(the figure #18 asks for):", "",
              "| point | global own p50 ms (global-standin - standin) | Tier-1 own p50 ms "
              "(tier1 - echo) | global own CPU ms/req (router+Envoy) | Tier-1 CPU ms/req "
              "(picker+Envoy) | within |", "| --- | --- | --- | --- | --- | --- |"]
    for row in doc["summary"]:
        lines.append(f"| {row['point']} | {row['own_p50_ms']:.2f} | "
                     f"{row['tier1_p50_ms']:.2f} | {row['own_cpu_ms']:.3f} | "
                     f"{row['tier1_cpu_ms']:.3f} | {'yes' if row['own_within'] else 'no'} |")
    lines += ["", "Stacked, the global tier in front of the real Tier 1:", "",
              "| point | added p50 ms (global - tier1) | Tier-1 own p50 ms "
              "(tier1 - echo) | global CPU ms/req (router+Envoy) | Tier-1 CPU ms/req "
              "(picker+Envoy) | within |", "| --- | --- | --- | --- | --- | --- |"]
    for row in doc["summary"]:
        lines.append(f"| {row['point']} | {row['added_p50_ms']:.2f} | "
                     f"{row['tier1_p50_ms']:.2f} | {row['global_cpu_ms']:.3f} | "
                     f"{row['tier1_cpu_ms']:.3f} | "
                     f"{'yes' if row['stacked_within'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.global_overhead")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="igw-global-overhead-") as tmp:
        work = Path(tmp)
        scripts = _scripts(work)
        echo_port, standin_port = free_ports(2)
        echo = start_child("echo", [sys.executable, "-m", "bench.echo_server", "--port",
                                    str(echo_port)], work / "echo.log")
        standin = start_child("standin", [
            sys.executable, "-m", "bench.standin_region", "--port", str(standin_port),
            "--state-dir", str(work / "standin")], work / "standin.log")
        children = []
        try:
            wait_log_line(echo, lambda line: line.startswith("echo ready"), 20)
            wait_log_line(standin, lambda line: line.startswith("standin-region ready"), 20)
            tier1_doc = _tier1_doc(echo_port)
            tier1, tier1_url, tier1_state = _serve(work, "tier1", ["serve"], tier1_doc)
            children.append(tier1)
            glob_doc = _global_doc("tier1", tier1_doc["spec"]["listener"]["port"],
                                   tier1_state / "tls" / "ca.pem")
            glob, glob_url, _ = _serve(work, "global", ["global", "serve"], glob_doc)
            children.append(glob)
            front_doc = _global_doc("standin", standin_port,
                                    ca_file(work / "standin"))
            front, front_url, _ = _serve(work, "global-standin", ["global", "serve"],
                                         front_doc)
            children.append(front)
            time.sleep(1.0)  # the routers' first polls
            tier1_pids = {f"tier1-{k}": v for k, v in _pids(tier1.pid).items()}
            glob_pids = {f"global-{k}": v for k, v in _pids(glob.pid).items()}
            front_pids = {f"global-{k}": v for k, v in _pids(front.pid).items()}
            backends = {"echo": echo.pid}
            standins = {"standin": standin.pid,
                        **{f"standin-{k}": v for k, v in _pids(standin.pid).items()}}
            paths = {"echo": (f"http://127.0.0.1:{echo_port}/v1/chat/completions", backends),
                     "tier1": (f"{tier1_url}/v1/chat/completions",
                               {**tier1_pids, **backends}),
                     "global": (f"{glob_url}/v1/chat/completions",
                                {**glob_pids, **tier1_pids, **backends}),
                     "standin": (f"https://127.0.0.1:{standin_port}/v1/chat/completions",
                                 standins),
                     "global-standin": (f"{front_url}/v1/chat/completions",
                                        {**front_pids, **standins})}
            for spec, script in scripts.items():
                print(f"global overhead: {spec.label}", flush=True)
                points += _measure(paths, script, spec, args.duration, args.rounds)
        finally:
            for child in reversed(children):
                child.stop(timeout=40)
            standin.stop()
            echo.stop()
    summary = [_summary(points, spec) for spec in scripts]
    doc = {
        "date": utc_stamp(),
        "command": " ".join(["python -m bench.global_overhead",
                             *(sys.argv[1:] if argv is None else argv)]),
        "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
        "halt_poll": _halt_poll(), "duration_s": args.duration, "rounds": args.rounds,
        "points": points, "summary": summary,
    }
    write_results(args.out, "global_overhead", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
