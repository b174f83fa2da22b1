"""Where a limit shared by every replica should be checked: measured, both ways.

    python -m bench.ratelimit [--duration 5] [--repeats 3]

The question (issue #17, docs/ratelimits.md): (a) Envoy's rate-limit filter
(`envoy.filters.http.ratelimit`) calling a rate-limit service over
`envoy.service.ratelimit.v3`, which asks Redis on every request, or (b) the picker
admitting on local counters that a background task exchanges with Redis.

Three targets behind the same real Envoy, the same ext_proc filter on the gateway's
one-message route (bench/ext_proc_servers.py's bootstrap), the same echo backend and
one real redis-server (running for every target, so its idle cost is in each):
- `none`: the h2-grpc ext_proc stub, no limits (the baseline);
- `rls` (a): the same stub, plus Envoy's rate-limit filter before ext_proc, with a
  per-route action sending the tenant (a `generic_key` entry) as the descriptor to
  bench/ratelimit_servers.py's rate-limit service (grpcio asyncio, one pipelined
  INCRBY + EXPIRE per call);
- `picker` (b): the stub with the product's limiter on it (admit per request, release
  at the stream's end, a background sync every 50 ms with 50 configured tenants).
Limits high enough that nothing is refused.

Load: wrk as bench/overhead.py runs it (1 KB chat body, keep-alive, plain HTTP), at
concurrency 1 and 32 after a warm-up; `--repeats` rounds with the targets in rotated
order; medians. Per point: p50 / p99, requests/s, CPU per request of every process
(Envoy, stub, rate-limit service, Redis) from /proc. Ratios are paired with the
baseline of the same round. Results: bench/results/ratelimit.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from bench.ext_proc_servers import Running, _median, bootstrap, machine_context, start_envoy
from bench.ext_proc_servers import run as ext_proc_run
from bench.output import write_results
from bench.procs import Child, start_child, wait_log_line
from igw.ports import free_ports
from igw_envoy.clusters import UPSTREAM_HTTP_OPTIONS

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "none"
TARGETS = (BASELINE, "rls", "picker")
CONCURRENCY = (1, 32)
RATELIMIT = "envoy.filters.http.ratelimit"
RATELIMIT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
# wrk sends the same request every time: the tenant descriptor is a constant entry, the
# same one entry a request_headers action on the tenant header would make
TENANT = "bench"
DOMAIN = "igw-bench"
REDIS_SERVER = "/usr/bin/redis-server"


def _grpc_cluster(name: str, port: int) -> dict:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    return {
        "name": name, "type": "STATIC", "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {UPSTREAM_HTTP_OPTIONS: {
            "@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": address}}]}]},
    }


def with_rate_limit_service(config: dict, rls_port: int) -> dict:
    """The ext_proc bootstrap plus Envoy's rate-limit filter (first in the chain), the
    tenant descriptor on every route, and the service's cluster."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    hcm["http_filters"].insert(0, {"name": RATELIMIT, "typed_config": {
        "@type": RATELIMIT_TYPE,
        "domain": DOMAIN,
        "timeout": "1s",
        "failure_mode_deny": False,
        "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}},
                               "transport_api_version": "V3"},
    }})
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            route["route"]["rate_limits"] = [{"actions": [{"generic_key": {
                "descriptor_key": "tenant", "descriptor_value": TENANT}}]}]
    config["static_resources"]["clusters"].append(_grpc_cluster("rls", rls_port))
    return config


@contextlib.contextmanager
def redis(work: Path) -> Iterator[Child]:
    (port,) = free_ports(1)
    child = start_child("redis-server", [
        REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"],
        work / "redis.log")
    try:
        wait_log_line(child, lambda line: "Ready to accept connections" in line, 15)
        child.port = port  # type: ignore[attr-defined]
        yield child
    finally:
        child.stop()


def _server(kind: str, port: int, redis_port: int, logs: Path, limit: int | None) -> Child:
    extra = [] if limit is None else ["--limit", str(limit)]
    child = start_child(kind, [sys.executable, "-m", "bench.ratelimit_servers", kind,
                               str(port), str(redis_port), *extra], logs / f"{kind}.log")
    wait_log_line(child, lambda line: line.startswith("ratelimit ready"), 20)
    return child


@contextlib.contextmanager
def running(target: str, work: Path, echo_port: int, redis_child: Child,
            limit: int | None = None) -> Iterator[Running]:
    """One target up behind Envoy; `limit` (requests per minute) for tests that check that
    each design really refuses (the benchmark's default refuses nothing)."""
    listen, admin, stub_port, rls_port = free_ports(4)
    logs = Path(tempfile.mkdtemp(prefix=f"{target}-", dir=work))
    redis_port = redis_child.port  # type: ignore[attr-defined]
    children: list[Child] = []
    try:
        pids = {"redis": redis_child.pid}
        if target == "picker":
            stub = _server("picker", stub_port, redis_port, logs, limit)
        else:
            stub = start_child("stub", [sys.executable, "-m", "bench.ext_proc_stubs",
                                        "h2-grpc", str(stub_port)], logs / "stub.log")
            wait_log_line(stub, lambda line: line.startswith("stub ready"), 20)
        children.append(stub)
        pids["stub"] = stub.pid
        config = bootstrap(listen, admin, echo_port, stub_port, 1)
        if target == "rls":
            rls = _server("rls", rls_port, redis_port, logs, limit)
            children.append(rls)
            pids["rls"] = rls.pid
            config = with_rate_limit_service(config, rls_port)
        pids["envoy"] = start_envoy(config, admin, logs, children).pid
        yield Running(target, f"http://127.0.0.1:{listen}/v1/chat/completions", admin, pids)
    finally:
        for child in reversed(children):
            child.stop()


def summarize(samples: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target, by_conc in samples.items():
        out[target] = {}
        for conc, points in by_conc.items():
            base = samples[BASELINE][conc]
            paired = list(zip(points, base, strict=False))
            total = [sum(p["cpu_ms"].values()) for p in points]
            per_process = {k: _median([p["cpu_ms"].get(k, 0.0) for p in points])
                           for k in points[0]["cpu_ms"]}
            out[target][conc] = {
                "rps": _median([p["rps"] for p in points]),
                "p50_ms": _median([p["p50_ms"] for p in points]),
                "p99_ms": _median([p["p99_ms"] for p in points]),
                "added_p50_ms": _median([p["p50_ms"] - b["p50_ms"] for p, b in paired]),
                "added_p99_ms": _median([p["p99_ms"] - b["p99_ms"] for p, b in paired]),
                "p50_ratio": _median([p["p50_ms"] / b["p50_ms"] for p, b in paired]),
                "p99_ratio": _median([p["p99_ms"] / b["p99_ms"] for p, b in paired]),
                "rps_ratio": _median([p["rps"] / b["rps"] for p, b in paired]),
                "cpu_ms_total": _median(total),
                "cpu_ratio": _median([sum(p["cpu_ms"].values()) / sum(b["cpu_ms"].values())
                                      for p, b in paired]),
                "added_cpu_ms": _median([sum(p["cpu_ms"].values()) - sum(b["cpu_ms"].values())
                                         for p, b in paired]),
                "cpu_ms": per_process,
                "errors": sum(p["errors"] for p in points),
                "repeats": len(points),
            }
    return out


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        "# Shared rate limits: Envoy's rate-limit service (a) or the picker's own counters (b)",
        "",
        f"`{doc['command']}` on {doc['date']}: {doc['cores']} cores shared with other work "
        f"(load average {doc['load_average_start']:.1f} at the start, "
        f"{doc['load_average_end']:.1f} at the end; machine {100 * doc['machine_busy']:.0f} % "
        f"busy during the run); {doc['versions_line']}; {doc['wrk']}. "
        f"{doc['duration_s']:g} s per point after a {doc['warmup_s']:g} s warm-up, "
        f"{doc['repeats']} rounds in rotated order, medians; ratios paired with the same "
        "round's `none`. 1 KB chat body, plain HTTP, backend bench/echo_server.py, one "
        "redis-server for all. Method: bench/ratelimit.py.",
        "",
        "| target | conc. | req/s (× none) | p50 (× none) | p99 (× none) | added p50 / p99 "
        "| CPU ms/request, all processes (× none) | per process | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for target in doc["targets"]:
        for conc in CONCURRENCY:
            p = s[target][conc]
            per = ", ".join(f"{k} {v:.3f}" for k, v in p["cpu_ms"].items())
            base = target == BASELINE
            added = "-" if base else f"{p['added_p50_ms']:+.3f} / {p['added_p99_ms']:+.3f} ms"
            lines.append(
                f"| {target} | {conc} | {p['rps']:.0f} ({p['rps_ratio']:.2f}×) "
                f"| {p['p50_ms']:.3f} ms ({p['p50_ratio']:.2f}×) "
                f"| {p['p99_ms']:.3f} ms ({p['p99_ratio']:.2f}×) | {added} "
                f"| {p['cpu_ms_total']:.3f} ({p['cpu_ratio']:.2f}×) | {per} | {p['errors']} |")
    m = doc["micro"]
    lines += [
        "", "## (b) alone, in process", "",
        f"- `admit` + `release`, a tenant with tenant-wide and per-model limits, "
        f"{m['keys']} keys configured: {m['admit_release_us']:.2f} µs CPU per request.",
        f"- a background sync (one EVALSHA) as it runs under this load: the tenant's 2 "
        f"used keys and the slice of idle ones due: {m['sync_cpu_us']:.0f} µs of the "
        f"picker's CPU, {m['sync_wall_us']:.0f} µs wall; every 50 ms that is "
        f"{m['sync_cpu_us'] * 20 / 1e4:.2f} % of a core, whatever the request rate.",
        f"- a sync of all {m['keys']} keys (every tenant sending): "
        f"{m['full_sync_cpu_us']:.0f} µs CPU, {m['full_sync_wall_us']:.0f} µs wall "
        f"({m['full_sync_cpu_us'] * 20 / 1e4:.2f} % of a core at 20 syncs/s).",
        "", "## Verdict", "", *verdict(s), ""]
    return "\n".join(lines)


def verdict(s: dict[str, Any]) -> list[str]:
    out = []
    for conc in CONCURRENCY:
        a, b = s["rls"][conc], s["picker"][conc]
        out.append(
            f"- concurrency {conc}: (a) Envoy + rate-limit service: p50 {a['p50_ratio']:.2f}×, "
            f"p99 {a['p99_ratio']:.2f}×, CPU per request {a['cpu_ratio']:.2f}× "
            f"({a['added_cpu_ms']:+.3f} ms), {a['rps_ratio']:.2f}× the requests/s; "
            f"(b) the picker's counters: p50 {b['p50_ratio']:.2f}×, p99 {b['p99_ratio']:.2f}×, "
            f"CPU {b['cpu_ratio']:.2f}× ({b['added_cpu_ms']:+.3f} ms), "
            f"{b['rps_ratio']:.2f}× the requests/s.")
    return out


def micro(redis_port: int, tenants: int = 50, calls: int = 200_000) -> dict[str, float]:
    """In-process cost of (b) alone: admit + release per request, and one background sync
    (client CPU and wall time, 2 x `tenants` keys) against the real redis-server."""
    import asyncio
    import time

    from contract.config import CoordinationConfig, RateLimits
    from picker.coordination.bus import redis_client
    from picker.tenants.limits import Limiter

    big = RateLimits(requests_per_minute=10**9, tokens_per_minute=10**12,
                     max_concurrent_requests=10**9)
    table = {}
    for i in range(tenants):
        table[(f"t{i}", "")] = big
        table[(f"t{i}", "m")] = big
    lim = Limiter()
    lim.configure(table)
    cpu0 = time.process_time()
    for _ in range(calls):
        lim.release(lim.admit("t0", "m", 300, time.monotonic()))
    admit_us = (time.process_time() - cpu0) / calls * 1e6

    async def syncs(n: int, every_key: bool) -> tuple[float, float]:
        settings = CoordinationConfig(url=f"redis://127.0.0.1:{redis_port}/0")
        await lim.start(lambda: redis_client(settings, None, 1.0, 2), "igw:micro",
                        replica="micro")
        sync = lim._sync
        assert sync is not None
        used = [k for k in lim.all_keys() if k.tenant == "t0"]
        cpu = wall = 0.0
        for _ in range(n):
            for key in lim.all_keys() if every_key else used:
                key.dirty = True
            c0, w0 = time.process_time(), time.perf_counter()
            await sync.sync_once()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - w0
        await lim.stop()
        return cpu / n * 1e6, wall / n * 1e6

    full_cpu, full_wall = asyncio.run(syncs(100, True))
    typical_cpu, typical_wall = asyncio.run(syncs(200, False))
    return {"admit_release_us": admit_us, "keys": 2 * tenants,
            "full_sync_cpu_us": full_cpu, "full_sync_wall_us": full_wall,
            "sync_cpu_us": typical_cpu, "sync_wall_us": typical_wall}


def run(duration: float, warmup: float, repeats: int, work: Path) -> dict[str, Any]:
    """(b)'s in-process costs, then every target in bench/ext_proc_servers.run's rounds."""
    with redis(work) as redis_child:
        figures = micro(redis_child.port)  # type: ignore[attr-defined]

        def start(target: str, work: Path, echo_port: int) -> AbstractContextManager[Running]:
            return running(target, work, echo_port, redis_child)

        samples = ext_proc_run(list(TARGETS), duration, warmup, repeats, 1, work, start)
    return {"micro": figures, "samples": samples}


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ratelimit")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each point")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every target")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    described = command or "python -m bench.ratelimit " + " ".join(argv or [])
    with (machine_context(described) as context,
          tempfile.TemporaryDirectory(prefix="igw-ratelimit-") as tmp):
        measured = run(args.duration, args.warmup, args.repeats, Path(tmp))
    doc = {
        **context,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "repeats": args.repeats,
        "targets": list(TARGETS),
        "summary": summarize(measured["samples"]),
        "micro": measured["micro"],
        "samples": measured["samples"],
    }
    write_results(args.out, "ratelimit", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
