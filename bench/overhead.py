"""What a router adds per request when the model server costs nothing.

    igw bench --overhead            (or: python -m bench.overhead [--duration 8])

Backend: bench/echo_server.py, a raw-asyncio HTTP/1.1 server answering a fixed one-token
completion (and idle vLLM metrics, so the gateway sees a ready pod), in its own process.
Routers in front of it, one at a time: none (`direct`), plain Envoy ROUND_ROBIN, this
gateway (`igw serve`, llm-d; once more with its admission control switched off, to
separate the pipeline's cost from the admission queue's pacing), sglang-router and
vllm-router (cache_aware, sglang-router's default; power_of_two refuses a single worker).

Load: `wrk` (C, closed loop, keep-alive) with a Lua script POSTing a 1 KB non-streaming
chat body (max_tokens 1), at 1 and at 32 concurrent connections, after a short warm-up.
The gateway, Envoy and sglang-router are HTTPS (same certificate); vllm-router (no TLS
option) and direct are plain HTTP.

Per point: latency p50 / p99 (wrk's own histogram), added latency over `direct` at the
same concurrency, requests/s, and CPU per request of every process from /proc
(utime+stime before/after ÷ requests); for the gateway, Envoy and the picker separately,
the picker's also net of its idle background work (metrics scraping) measured just
before. Results: bench/results/overhead.md and overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fleet import Pod
from bench.output import utc_stamp, write_results
from bench.procs import cpu_seconds, start_child, wait_log_line
from bench.routers import ROUTERS, Router, versions
from igw.ports import free_ports

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "echo-model"
TARGETS = ("direct", "envoy-rr", "igw-llm-d", "igw-llm-d-noadmit", "sglang-cache", "vllm-cache")
CONCURRENCY = (1, 32)
WARMUP_S = 2
IDLE_S = 3.0
LUA = """
wrk.method = "POST"
wrk.body = [[BODY]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\\"requests\\": %d, \\"duration_us\\": %d, \\"errors\\": %d, "
    .. "\\"status_errors\\": %d, \\"p50_us\\": %d, "
    .. "\\"p90_us\\": %d, \\"p99_us\\": %d, \\"mean_us\\": %.1f}\\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


class _EchoFleet:
    """What a Router needs from a fleet: one pool with one pod (the echo server)."""

    def __init__(self, port: int) -> None:
        self.pod = Pod("echo", "none", MODEL, port)

    def pools(self) -> dict[str, list[Pod]]:
        return {MODEL: [self.pod]}


def _body() -> str:
    prompt = " ".join(f"word{i}" for i in range(170))[:1000]
    return json.dumps({"model": MODEL, "max_tokens": 1, "stream": False,
                       "messages": [{"role": "user", "content": prompt}]})


def wrk_threads(concurrency: int) -> int:
    """wrk's threads for `concurrency` connections (each thread runs its own Lua state)."""
    return 1 if concurrency == 1 else 2


def _wrk(url: str, script: Path, concurrency: int, seconds: float) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk not found: apt-get install -y wrk")
    threads = wrk_threads(concurrency)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [wrk, "-t", str(threads), "-c", str(concurrency), "-d", f"{seconds:g}s", "--latency",
         "-s", str(script), url],
        capture_output=True, text=True, timeout=seconds + 30, check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for line in proc.stdout.splitlines():
        if line.startswith("WRKJSON "):
            out = json.loads(line[8:])
            out["wrk_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime
                                                                     - before.ru_stime)
            return out
    raise RuntimeError(f"wrk gave no result: {proc.stdout}\n{proc.stderr}")


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}


def _with_headers(script: Path, headers: dict[str, str]) -> Path:
    """The wrk script, plus headers this router needs on every request (an API key)."""
    if not headers:
        return script
    lines = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers.items())
    out = script.with_name(f"{script.stem}-{abs(hash(lines))}.lua")
    out.write_text(script.read_text().replace('wrk.method = "POST"\n',
                                              'wrk.method = "POST"\n' + lines, 1))
    return out


def measure(target: str, echo_port: int, echo_pid: int, work: Path, tls, duration: float,
            script: Path) -> dict[str, Any]:
    router: Router | None = None
    try:
        if target == "direct":
            url = f"http://127.0.0.1:{echo_port}/v1/chat/completions"
            pids = {"echo": echo_pid}
        else:
            router = ROUTERS[target].make()
            fleet = _EchoFleet(echo_port)
            router.start(work, fleet, tls, 1.0)  # type: ignore[arg-type]
            router.wait_ready(fleet)  # type: ignore[arg-type]
            url = router.url_for_pool(MODEL)
            pids = {"echo": echo_pid, **router.pids()}
            pids.pop("igw-supervisor", None)
            script = _with_headers(script, router.request_headers())
        # idle CPU of the router's processes (background work such as metrics scraping)
        c0 = _cpu(pids)
        time.sleep(IDLE_S)
        c1 = _cpu(pids)
        idle_rate = {k: (c1[k] - c0[k]) / IDLE_S for k in pids}
        points = []
        for conc in CONCURRENCY:
            _wrk(url, script, conc, WARMUP_S)
            before = _cpu(pids)
            res = _wrk(url, script, conc, duration)
            after = _cpu(pids)
            n = max(res["requests"], 1)
            secs = res["duration_us"] / 1e6
            cpu_ms = {k: 1000 * (after[k] - before[k]) / n for k in pids}
            net_ms = {k: 1000 * max(0.0, after[k] - before[k] - idle_rate[k] * secs) / n
                      for k in pids}
            points.append({
                "concurrency": conc,
                "requests": res["requests"],
                "errors": res["errors"] + res["status_errors"],
                "rps": round(res["requests"] / secs, 1),
                "p50_ms": res["p50_us"] / 1000, "p90_ms": res["p90_us"] / 1000,
                "p99_ms": res["p99_us"] / 1000, "mean_ms": res["mean_us"] / 1000,
                "cpu_ms_per_request": {k: round(v, 4) for k, v in cpu_ms.items()},
                "cpu_ms_per_request_net_of_idle": {k: round(v, 4) for k, v in net_ms.items()},
                "wrk_cpu_ms_per_request": round(1000 * res["wrk_cpu_s"] / n, 4),
            })
        return {"target": target, "url": url, "idle_core_share": idle_rate, "points": points,
                "describe": router.describe() if router else {"name": "direct"}}
    finally:
        if router is not None:
            router.stop()


def render(doc: dict[str, Any]) -> str:
    rows = {(r["target"], p["concurrency"]): p for r in doc["results"] for p in r["points"]}
    lines = [
        "# Overhead benchmark",
        "",
        f"`{doc['command']}` on {doc['date']}, {doc['cores']} cores shared with other work "
        f"(load average {doc['load_average']:.1f} at the start); {doc['versions_line']}. "
        f"wrk {doc['wrk']}, {doc['duration_s']:g} s per point after a {WARMUP_S} s warm-up, "
        "1 KB non-streaming chat body, max_tokens 1, backend bench/echo_server.py (costs "
        "~nothing)" + (f", answering an SSE stream of {doc['stream_events']} token events"
                       if doc.get("stream_events") else "") + ". Method: bench/overhead.py.",
        "",
        "| router | conc. | p50 | p99 | added p50 / p99 over direct | req/s | errors "
        "| CPU per request, ms (net of idle background work) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in doc["results"]:
        for p in r["points"]:
            direct = rows.get(("direct", p["concurrency"]))
            if direct and r["target"] != "direct":
                added = (f"{p['p50_ms'] - direct['p50_ms']:+.2f} / "
                         f"{p['p99_ms'] - direct['p99_ms']:+.2f} ms")
            else:
                added = "-"
            cpu = ", ".join(
                f"{k} {v:.3f} ({p['cpu_ms_per_request_net_of_idle'][k]:.3f})"
                for k, v in p["cpu_ms_per_request"].items()
            )
            lines.append(
                f"| {r['target']} | {p['concurrency']} | {p['p50_ms']:.2f} ms "
                f"| {p['p99_ms']:.2f} ms | {added} | {p['rps']:.0f} | {p['errors']} | {cpu} |"
            )
    gw = next((r for r in doc["results"] if r["target"] == "igw-llm-d"), None)
    if gw:
        lines += ["", "Gateway targets: picker CPU per request ≤ 0.4 ms; added p50 at "
                      "concurrency 1 ≤ 1 ms."]
        direct1 = rows.get(("direct", 1))
        for p in gw["points"]:
            picker = p["cpu_ms_per_request_net_of_idle"].get("picker")
            envoy = p["cpu_ms_per_request_net_of_idle"].get("envoy")
            extra = ""
            if p["concurrency"] == 1 and direct1:
                extra = f", added p50 {p['p50_ms'] - direct1['p50_ms']:.2f} ms"
            lines.append(f"- concurrency {p['concurrency']}: picker {picker:.3f} ms CPU/request, "
                         f"Envoy {envoy:.3f} ms{extra}.")
        lines.append(f"- picker idle background CPU: "
                     f"{100 * gw['idle_core_share'].get('picker', 0):.1f}% of a core.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="igw bench --overhead")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per point")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--stream-events", type=int, default=0,
                   help="the backend streams this many token events per answer (SSE)")
    args = p.parse_args(argv)
    from bench.runner import tls_material

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    script_body = LUA.replace("BODY", _body())
    results = []
    with tempfile.TemporaryDirectory(prefix="igw-overhead-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(script_body)
        tls = tls_material(work)
        (port,) = free_ports(1)
        echo = start_child("echo", [sys.executable, "-m", "bench.echo_server", "--port",
                                    str(port), "--stream-events", str(args.stream_events)],
                           work / "echo.log")
        try:
            wait_log_line(echo, lambda line: line.startswith("echo ready"), 20)
            for target in targets:
                print(f"overhead: {target}", flush=True)
                try:
                    results.append(measure(target, port, echo.pid, work, tls, args.duration,
                                           script))
                except Exception as exc:  # report and go on with the other targets
                    print(f"  {target} failed: {exc}", flush=True)
                    results.append({"target": target, "error": str(exc), "points": []})
        finally:
            echo.stop()
    vers = versions()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[:1]
    doc = {
        "date": utc_stamp(),
        "command": "igw bench --overhead " + " ".join(argv or []),
        "cores": os.cpu_count(),
        "stream_events": args.stream_events,
        "load_average": os.getloadavg()[0],
        "versions": vers,
        "versions_line": ", ".join(f"{k} {v}" for k, v in vers.items()),
        "wrk": wrk_version[0] if wrk_version else "?",
        "duration_s": args.duration,
        "results": results,
    }
    write_results(args.out, "overhead", doc, render(doc))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
