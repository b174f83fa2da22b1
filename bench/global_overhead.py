"""What the global tier adds per request, next to what Tier 1 itself costs.

    python -m bench.global_overhead [--duration 8]

Backend: bench/echo_server.py (a one-token answer that costs nothing). In front of it a
real Tier-1 gateway (`igw serve`, one pool, admission off), and in front of that the real
global tier (`igw global serve`, one region: that gateway). Same run, alternating: wrk
(bench.overhead's 1 KB non-streaming chat body) against the Tier-1 listener directly, then
against the global listener, at 1 and 8 connections. Per point: latency p50/p99, requests/s, and CPU
per request of each process (Tier-1 picker and Envoy; global router and its Envoy).
The figure #18 asks for: the global tier's added p50 and CPU per request (router +
Envoy) against the Tier-1 gateway's own (picker + Envoy, measured on the direct run).
Results: bench/results/global_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.output import write_results
from bench.overhead import LUA, MODEL, _body, _cpu, _wrk
from bench.procs import (
    descendants,
    process_name,
    start_child,
    start_piped,
    wait_line,
    wait_log_line,
)
from igw.ports import free_ports

RESULTS = Path(__file__).resolve().parent / "results"
CONCURRENCY = (1, 8)
WARMUP_S = 2.0
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


def _global_doc(tier1_port: int, ca: Path) -> dict[str, Any]:
    listen, picker, metrics, envoy_admin = free_ports(4)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
        "metadata": {"name": "bench-global"},
        "spec": {
            "regions": [{"name": "only", "endpoint": f"127.0.0.1:{tier1_port}",
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


def _point(url: str, script: Path, concurrency: int, seconds: float, pids: dict[str, int]
           ) -> dict[str, Any]:
    _wrk(url, script, concurrency, WARMUP_S)
    before = _cpu(pids)
    out = _wrk(url, script, concurrency, seconds)
    after = _cpu(pids)
    requests = max(out["requests"], 1)
    out["rps"] = out["requests"] / (out["duration_us"] / 1e6)
    out["cpu_ms_per_request"] = {k: 1000 * (after[k] - before[k]) / requests for k in pids}
    return out


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# The global tier's extra hop", "",
        f"{doc['date']}, {doc['cores']} cores, load average {doc['load_average']:.1f}; "
        f"`{doc['command']}`; {doc['duration_s']:g} s per point after a {WARMUP_S:g} s warm-up.",
        "", "| connections | path | p50 ms | p99 ms | req/s | CPU ms/request |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for point in doc["points"]:
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in point["cpu_ms_per_request"].items())
        lines.append(f"| {point['connections']} | {point['path']} | {point['p50_us'] / 1000:.2f} "
                     f"| {point['p99_us'] / 1000:.2f} | {point['rps']:.0f} | {cpu} |")
    lines += ["", "| connections | added p50 ms (global - direct) | Tier-1 own p50 ms "
              "(direct - echo) | global CPU ms/req (router+Envoy) | Tier-1 CPU ms/req "
              "(picker+Envoy) |", "| --- | --- | --- | --- | --- |"]
    for row in doc["summary"]:
        lines.append(f"| {row['connections']} | {row['added_p50_ms']:.2f} | "
                     f"{row['tier1_p50_ms']:.2f} | {row['global_cpu_ms']:.3f} | "
                     f"{row['tier1_cpu_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.global_overhead")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="igw-global-overhead-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(LUA.replace("BODY", _body()))
        (echo_port,) = free_ports(1)
        echo = start_child("echo", [sys.executable, "-m", "bench.echo_server", "--port",
                                    str(echo_port)], work / "echo.log")
        children = []
        try:
            wait_log_line(echo, lambda line: line.startswith("echo ready"), 20)
            tier1_doc = _tier1_doc(echo_port)
            tier1, tier1_url, tier1_state = _serve(work, "tier1", ["serve"], tier1_doc)
            children.append(tier1)
            glob_doc = _global_doc(tier1_doc["spec"]["listener"]["port"],
                                   tier1_state / "tls" / "ca.pem")
            glob, glob_url, _ = _serve(work, "global", ["global", "serve"], glob_doc)
            children.append(glob)
            time.sleep(1.0)  # the router's first polls
            tier1_pids = {f"tier1-{k}": v for k, v in _pids(tier1.pid).items()}
            glob_pids = {f"global-{k}": v for k, v in _pids(glob.pid).items()}
            paths = {"echo": f"http://127.0.0.1:{echo_port}/v1/chat/completions",
                     "tier1": f"{tier1_url}/v1/chat/completions",
                     "global": f"{glob_url}/v1/chat/completions"}
            for concurrency in CONCURRENCY:
                for path, url in paths.items():
                    pids = {**tier1_pids, **glob_pids} if path == "global" else tier1_pids
                    print(f"global overhead: {path} c={concurrency}", flush=True)
                    point = _point(url, script, concurrency, args.duration, pids)
                    points.append({"path": path, "connections": concurrency, **point})
        finally:
            for child in reversed(children):
                child.stop(timeout=40)
            echo.stop()
    summary = []
    for concurrency in CONCURRENCY:
        by = {p["path"]: p for p in points if p["connections"] == concurrency}
        cpu_g = by["global"]["cpu_ms_per_request"]
        cpu_t = by["tier1"]["cpu_ms_per_request"]
        summary.append({
            "connections": concurrency,
            "added_p50_ms": (by["global"]["p50_us"] - by["tier1"]["p50_us"]) / 1000,
            "tier1_p50_ms": (by["tier1"]["p50_us"] - by["echo"]["p50_us"]) / 1000,
            "global_cpu_ms": sum(v for k, v in cpu_g.items() if k.startswith("global-")),
            "tier1_cpu_ms": sum(cpu_t.values()),
        })
    doc = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench.global_overhead " + " ".join(argv or []),
        "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
        "duration_s": args.duration, "points": points, "summary": summary,
    }
    write_results(args.out, "global_overhead", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
