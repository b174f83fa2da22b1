"""N gateway replicas behind an L4 front: the gateway as deployed behind an NLB.

A deployment runs several `igw serve` replicas behind a network load balancer, which
spreads client *connections* (not requests) over them; each picker then sees only its
share of the traffic. This module stands that up on loopback:

- N `igw serve` processes on the same generated config (bench/routers.py `gateway_config`),
  each with its own state dir and ports (listener, picker, admin, metrics, Envoy admin);
- a front Envoy with one `tcp_proxy` listener whose STATIC cluster round-robins TCP
  connections over the N TLS listeners (TLS passes through: clients see the replicas'
  own certificate). One worker (`--concurrency 1`), so the rotation is strict: every
  replica gets the same number of connections, as an NLB's flow hash gives on average;
- for coordinated runs a real `redis-server` (no persistence, loopback, a free port)
  whose URL every replica gets as `spec.coordination.url`.

The load generator sends from many clients (`ReplicatedGateway.clients`), each with its own
keep-alive pool: with one pool, its reused connections would pin most requests to whichever
replica got the first connection. `diagnostics` reports each replica's share of the
measured run's connections and requests (from each replica's Envoy stats).

`scrape_load` measures what scraping costs the pods at each N: uncoordinated replicas
each scrape every pod, coordinated ones share scrape results (each pod scraped by its
owner among the live replicas, picker/coordination/scrapes.py).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.fleet import SimFleet
from bench.procs import Child, cpu_seconds, port_open, start_child, wait_until
from bench.routers import (
    START_TIMEOUT_S,
    Router,
    RouterSpec,
    TlsMaterial,
    gateway_config,
    gateway_pids,
    probe,
    spawn_gateway,
    wait_gateway,
)
from igw.ports import free_port, free_ports
from igw_envoy.binary import envoy_command

REDIS_SERVER = "/usr/bin/redis-server"
TCP_PROXY_TYPE = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
# many independent clients, so that an L4 front spreading connections spreads requests too
CLIENTS = 32
STATS_FILTER = r"^http\.ingress_https\.downstream_(cx|rq)_total$"


@dataclass(frozen=True)
class ReplicaSpec(RouterSpec):
    """`igw-llm-d` as N replicas behind the L4 front, coordinated through Redis or not."""

    replicas: int
    coordinated: bool

    def make(self) -> Router:
        return ReplicatedGateway(self)


def replica_spec(replicas: int, coordinated: bool) -> ReplicaSpec:
    """`igw-llm-d-x2` (coordinated) / `igw-llm-d-x2-nocoord`."""
    suffix = "" if coordinated else "-nocoord"
    how = "coordinated" if coordinated else "not coordinated"
    return ReplicaSpec(f"igw-llm-d-x{replicas}{suffix}", "igw", "llm-d",
                       f"gateway llm-d x{replicas} behind L4, {how}", replicas, coordinated)


def coordination_missing() -> str | None:
    """None if the gateway's config accepts `spec.coordination`, else why not."""
    from contract.config import GatewayConfig

    if "coordination" in {f.name for f in dataclasses.fields(GatewayConfig)}:
        return None
    return "the gateway config has no spec.coordination yet (contract/config.py)"


def front_bootstrap(listen: int, admin: int, backends: list[int]) -> dict[str, Any]:
    """Envoy bootstrap: one TCP listener round-robining connections over `backends`."""
    endpoints = [{"endpoint": {"address": {"socket_address": {
        "address": "127.0.0.1", "port_value": port}}}} for port in backends]
    listener = {
        "name": "front",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {"@type": TCP_PROXY_TYPE, "stat_prefix": "front",
                             "cluster": "replicas"},
        }]}],
    }
    cluster = {
        "name": "replicas",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "1s",
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": 100_000,
                                             "max_pending_requests": 100_000}]},
        "load_assignment": {"cluster_name": "replicas",
                            "endpoints": [{"lb_endpoints": endpoints}]},
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def start_redis(state: Path) -> tuple[Child, str]:
    """A throwaway redis-server on a free loopback port; (child, redis:// URL)."""
    port = free_port()
    state.mkdir(parents=True, exist_ok=True)
    argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(state)]
    child = start_child("redis-server", argv, state / "redis.log")
    wait_until(lambda: port_open(port), child, START_TIMEOUT_S, "redis-server")
    return child, f"redis://127.0.0.1:{port}/0"


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def envoy_counters(admin_port: int) -> dict[str, int]:
    """The replica Envoy's downstream connection and request totals on its listener."""
    query = urllib.parse.urlencode({"format": "json", "filter": STATS_FILTER})
    doc = _get_json(f"http://127.0.0.1:{admin_port}/stats?{query}")
    out = {"connections": 0, "requests": 0}
    for stat in doc.get("stats", []):
        key = "connections" if stat.get("name", "").endswith("cx_total") else "requests"
        out[key] += int(stat.get("value", 0))
    return out


def shares(before: list[dict[str, int]], after: list[dict[str, int]]) -> dict[str, Any]:
    """Per replica: connections and requests of the measured run, and their shares."""
    rows = [{k: a[k] - b.get(k, 0) for k in a} for b, a in zip(before, after, strict=True)]
    out: dict[str, Any] = {"per_replica": rows}
    for key in ("connections", "requests"):
        total = sum(r[key] for r in rows)
        out[f"{key}_share"] = [round(r[key] / total, 3) if total else None for r in rows]
    return out


class ReplicatedGateway(Router):
    """N `igw serve` replicas behind the `tcp_proxy` front (+ Redis when coordinated)."""

    clients = CLIENTS

    def __init__(self, spec: RouterSpec) -> None:
        super().__init__(spec)
        assert isinstance(spec, ReplicaSpec)
        self.rspec = spec
        self.replicas: list[Child] = []
        self.configs: list[dict[str, Any]] = []
        self.redis_url = ""
        self._before: list[dict[str, int]] = []

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        self.tls = tls
        state = work / f"gw-{self.name}"
        if self.rspec.coordinated:
            why = coordination_missing()
            if why:
                raise RuntimeError(why)
            redis, self.redis_url = start_redis(state / "redis")
            self.children.append(redis)
        for i in range(self.rspec.replicas):
            config = gateway_config(self.spec, fleet, tls, time_scale)
            if self.redis_url:
                config["spec"]["coordination"] = {"url": self.redis_url}
            self.configs.append(config)
            self.replicas.append(spawn_gateway(state / f"replica-{i}", config))
        self.children += self.replicas
        for child in self.replicas:
            wait_gateway(child)
        self._start_front(state)
        self.urls = {model: f"https://127.0.0.1:{self.front_port}" for model in fleet.pools()}

    def _start_front(self, state: Path) -> None:
        self.front_port, self.front_admin = free_ports(2)
        backends = [c["spec"]["listener"]["port"] for c in self.configs]
        path = state / "front.yaml"
        path.write_text(yaml.safe_dump(front_bootstrap(self.front_port, self.front_admin,
                                                       backends), sort_keys=False))
        log = state / "front.log"
        log.unlink(missing_ok=True)
        front = start_child("l4-front", envoy_command(path, log_level="warning", concurrency=1),
                            log)
        self.children.append(front)
        wait_until(lambda: port_open(self.front_port), front, START_TIMEOUT_S, "l4 front")

    def wait_ready(self, fleet: SimFleet) -> None:
        """Every replica answers a request for every pool, then the front does."""
        for child, config in zip(self.replicas, self.configs, strict=True):
            url = f"https://127.0.0.1:{config['spec']['listener']['port']}"
            for model in fleet.pools():
                wait_until(lambda u=url, m=model: probe(u, m, self.tls), child,
                           START_TIMEOUT_S, f"{self.name} replica ({model})")
        super().wait_ready(fleet)

    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for child in self.children:
            if child not in self.replicas:
                out[child.name] = child.pid
        for i, child in enumerate(self.replicas):
            out.update(gateway_pids(child.pid, f"#{i}"))
        return out

    def _counters(self) -> list[dict[str, int]]:
        return [envoy_counters(c["spec"]["ports"]["envoyAdmin"]) for c in self.configs]

    def before_measure(self) -> None:
        self._before = self._counters()

    def diagnostics(self) -> dict[str, Any]:
        """Each replica's share of the measured run's connections and requests."""
        try:
            return {"replicas": self.rspec.replicas, "coordinated": self.rspec.coordinated,
                    "clients": self.clients, **shares(self._before, self._counters())}
        except Exception as exc:  # diagnostics must never fail a run
            return {"error": str(exc)}


# ----- pod-side scrape load --------------------------------------------------------------


# Scrape sharing's counters (picker/gateway_metrics.py), summed over the replicas.
SHARING_COUNTERS = {
    "shared_used": 'igw_coordination_shared_scrapes_received_total{result="used"}',
    "fallbacks": "igw_coordination_scrape_fallbacks_total",
}
FALLBACK_PODS = 'igw_coordination_scrape_pods{role="fallback"}'
SETTLE_TIMEOUT_S = 20.0


def picker_metrics_text(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def scrape_totals(text: str) -> dict[str, float]:
    """The picker's own scrapes per pod (`igw_pod_scrapes_total`, all outcomes): with
    shared scrape results, only the pods this replica scraped itself."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("igw_pod_scrapes_total{"):
            labels, value = line.rsplit(" ", 1)
            pod = labels.split('pod="', 1)[1].split('"', 1)[0]
            out[pod] = out.get(pod, 0.0) + float(value)
    return out


def metric_values(text: str, names: dict[str, str]) -> dict[str, float]:
    """{key: value} of the exact series `names` gives (0 when absent: not coordinated)."""
    wanted = {series: key for key, series in names.items()}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series in wanted:
            out[wanted[series]] = float(value)
    return out


def wait_settled(router: ReplicatedGateway) -> float:
    """Seconds until no coordinated replica scrapes a pod as a fallback (each has heard
    the others and their results arrive); bounded."""
    ports = [c["spec"]["ports"]["metrics"] for c in router.configs]
    started = time.monotonic()
    while True:
        pods = [metric_values(picker_metrics_text(p), {"f": FALLBACK_PODS})["f"] for p in ports]
        if not any(pods):
            return time.monotonic() - started
        if time.monotonic() - started > SETTLE_TIMEOUT_S:
            raise RuntimeError(f"scrape sharing not settled in {SETTLE_TIMEOUT_S:g} s: "
                               f"fallback pods per replica {pods}")
        time.sleep(0.2)


def measure_scrapes(fleet: SimFleet, router: ReplicatedGateway | None, seconds: float
                    ) -> dict[str, Any]:
    """Over `seconds` without traffic: scrapes per second of each pod (summed over the
    replicas) and the simulator's CPU; `router` None = no gateway (the idle baseline)."""
    ports = [c["spec"]["ports"]["metrics"] for c in router.configs] if router else []
    pids = router.pids() if router else {}
    pickers = {k: v for k, v in pids.items() if k.startswith("picker")}

    def read() -> tuple[list[str], float, dict[str, float]]:
        return ([picker_metrics_text(p) for p in ports], cpu_seconds(fleet.pid) or 0.0,
                {k: cpu_seconds(v) or 0.0 for k, v in pickers.items()})

    before, sim0, pick0 = read()
    t0 = time.monotonic()
    time.sleep(seconds)
    after, sim1, pick1 = read()
    elapsed = time.monotonic() - t0
    per_pod: dict[str, float] = {}
    sharing = dict.fromkeys(SHARING_COUNTERS, 0.0)
    for b_text, a_text in zip(before, after, strict=True):
        b, a = scrape_totals(b_text), scrape_totals(a_text)
        for pod, value in a.items():
            per_pod[pod] = per_pod.get(pod, 0.0) + (value - b.get(pod, 0.0)) / elapsed
        b_share = metric_values(b_text, SHARING_COUNTERS)
        for key, value in metric_values(a_text, SHARING_COUNTERS).items():
            sharing[key] += (value - b_share[key]) / elapsed
    return {"seconds": round(elapsed, 2), "scrapes_per_s_per_pod": per_pod,
            "sharing_per_s": sharing,
            "simulator_core_share": (sim1 - sim0) / elapsed,
            "picker_core_share": {k: (pick1[k] - pick0[k]) / elapsed for k in pick0}}


def scrape_load(work: Path, pods: list[dict[str, Any]], counts: list[int], seconds: float,
                tls: TlsMaterial, coordination: tuple[bool, ...] = (False, True)
                ) -> dict[str, Any]:
    """Pod-side cost of scraping every pod every 50 ms (time_scale 1, as deployed) with N
    replicas, N in `counts`, on one simulated fleet without traffic: uncoordinated (every
    replica scrapes every pod; `runs`) and coordinated with shared scrape results
    (`shared_runs`, measured once no pod is scraped as a fallback); the simulator's CPU
    over an idle baseline, per scrape."""
    fleet = SimFleet.start(work / "fleet", pods, seed=0, time_scale=1.0)
    out: dict[str, Any] = {"pods": len(pods), "seconds": seconds, "runs": {},
                           "vllm_page": prometheus_client_page_us()}
    try:
        idle = measure_scrapes(fleet, None, seconds)
        out["idle_simulator_core_share"] = round(idle["simulator_core_share"], 4)
        for coordinated in coordination:
            key = "shared_runs" if coordinated else "runs"
            for n in counts:
                out.setdefault(key, {})[n] = _scrape_run(work, fleet, tls, n, coordinated,
                                                         seconds, idle, len(pods))
    finally:
        fleet.stop()
    return out


def _scrape_run(work: Path, fleet: SimFleet, tls: TlsMaterial, n: int, coordinated: bool,
                seconds: float, idle: dict[str, Any], pods: int) -> dict[str, Any]:
    """One N: start the replicas, let the first scrapes (and sharing) settle, measure."""
    router = ReplicatedGateway(replica_spec(n, coordinated=coordinated))
    suffix = "-shared" if coordinated else ""
    try:
        router.start(work / f"scrape-x{n}{suffix}", fleet, tls, 1.0)
        time.sleep(1.0)  # past the first scrapes
        settle = wait_settled(router) if coordinated else 0.0
        run = measure_scrapes(fleet, router, seconds)
    finally:
        router.stop()
    total = sum(run["scrapes_per_s_per_pod"].values())
    extra = run["simulator_core_share"] - idle["simulator_core_share"]
    out = {
        "scrapes_per_s_per_pod": round(total / max(pods, 1), 1),
        "simulator_core_share": round(run["simulator_core_share"], 4),
        "simulator_us_per_scrape": round(1e6 * extra / total, 1) if total else None,
        "picker_core_share_each": [round(v, 4) for v in run["picker_core_share"].values()],
    }
    if coordinated:
        share = run["sharing_per_s"]
        out |= {"settle_s": round(settle, 1),
                "shared_used_per_s_per_pod": round(share["shared_used"] / max(pods, 1), 1),
                "fallbacks_per_s": round(share["fallbacks"], 1)}
    return out


# ----- the replicas table (bench/results/replicas.md + .json) ----------------------------


def replica_specs(counts: list[int], coordination: list[bool], repeats: int) -> list[ReplicaSpec]:
    """The runs of one scenario, repeats alternated (x1, x2, x4, x1, x2, x4, ...), so that
    a slow stretch of the shared machine does not fall on one configuration only. When
    both are compared, one replica runs uncoordinated only: it has no one to coordinate
    with, and it is the baseline of both."""
    one_round = [replica_spec(n, c) for n in counts for c in coordination
                 if not (c and n == 1 and len(coordination) > 1)]
    return [spec for _ in range(repeats) for spec in one_round]


def pooled_summary(runs: list[Any]) -> dict[str, Any]:
    """One configuration over its repeats: TTFT percentiles over every repeat's requests
    (the same arrivals each time), each repeat's p95, and each repeat's shares."""
    from bench.report import ttft_stats

    ok = [r for r in runs if r.ok]
    results = [res for r in ok for res in r.results]
    return {
        "label": runs[0].label,
        "repeats": len(ok),
        "failed": [r.error.splitlines()[0][:200] for r in runs if not r.ok],
        "requests": len(results),
        **ttft_stats(results),
        "ttft_p95_each": (each := [ttft_stats(r.results)["ttft_p95"] for r in ok]),
        # the figure compared: one repeat on a busy stretch of the shared machine moves a
        # pooled p95 far more than the median of the repeats' p95s
        "ttft_p95_median": statistics.median(each) if each else None,
        "connections_share": [r.diagnostics.get("connections_share") for r in ok],
        "requests_share": [r.diagnostics.get("requests_share") for r in ok],
        "machine_busy_share": [r.cpu.get("machine_busy_share") for r in ok],
        # how late the simulated fleet itself wrote its tokens (its worst pod's p99, wall ms):
        # the share of a change at N = 4 that is the testbed's CPU, which real GPUs do not
        # share with the gateway
        "fleet_late_p99_ms": [round(r.sim_lateness_p99_ms(), 2) for r in ok],
    }


def update_results(out_dirs: list[Path], names: list[str], path: Path, meta: dict[str, Any]
                   ) -> dict[str, Any]:
    """Merge the configurations run (<scenario>.json in each of `out_dirs`, repeats pooled
    across them) into `path` (.json), keeping what was measured there for the others."""
    from bench.report import load_runs

    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    scenarios = doc.setdefault("scenarios", {})
    for name in names:
        runs = [run for d in out_dirs if (d / f"{name}.json").exists()
                for run in load_runs(json.loads((d / f"{name}.json").read_text()))]
        by_router: dict[str, list[Any]] = {}
        for run in runs:
            by_router.setdefault(run.router, []).append(run)
        for router, mine in by_router.items():
            scenarios.setdefault(name, {})[router] = {**pooled_summary(mine),
                                                      "date": meta["date"],
                                                      "command": meta["command"]}
    path.write_text(json.dumps(doc, indent=1))
    return doc


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "n/a"
    return f"{100 * (value / base - 1):+.0f} %"


def _cell(s: dict[str, Any] | None) -> str:
    if not s or not s.get("repeats"):
        return "not run" if not s else "failed"
    each = "" if len(s["ttft_p95_each"]) < 2 else (
        " (p95 of each repeat " + ", ".join(f"{v:#.3g}" for v in s["ttft_p95_each"]) + ")")
    if s.get("fleet_late_p99_ms"):
        each += " fleet late p99 " + ", ".join(f"{v:.1f}" for v in s["fleet_late_p99_ms"]) + " ms"
    return f"{s['ttft_p50']:.3f} / **{s['ttft_p95']:.3f}** / {s['ttft_p99']:.3f}{each}"


def _share(s: dict[str, Any] | None) -> str:
    if not s or not s.get("repeats") or len(s["connections_share"][0] or []) < 2:
        return ""
    conn = "/".join(f"{100 * v:.0f}" for v in s["connections_share"][0] or [])
    req = "/".join(f"{100 * v:.0f}" for v in s["requests_share"][0] or [])
    return f"{conn} ({req})"


def _baseline(routers: dict[str, Any], s: dict[str, Any] | None) -> float | None:
    """One replica's median p95 from the run that measured `s` (a rerun of some
    configurations is compared with its own single gateway, not an older run's on another
    machine load); the single uncoordinated gateway where that run had none."""
    ones = [routers.get("igw-llm-d-x1-nocoord"), routers.get("igw-llm-d-x1")]
    same = [o for o in ones if o and s and o.get("command") == s.get("command")
            and o.get("date") == s.get("date")]
    base = (same or ones[:1])[0] or {}
    return base.get("ttft_p95_median")


def replica_table(doc: dict[str, Any], counts: tuple[int, ...] = (1, 2, 4),
                  family: bool = False) -> list[str]:
    """Per scenario (`family`: per family member instead) and N: TTFT p50/p95/p99 not
    coordinated and coordinated, the median of the repeats' p95 vs one replica's (the
    single gateway as deployed today; `_baseline`), and the shares."""
    lines = [
        "| scenario | N | not coordinated p50 / p95 / p99 (s) | median p95 vs N = 1 "
        "| coordinated p50 / p95 / p99 (s) | median p95 vs N = 1 | target (≤ +10 %) "
        "| connection (request) share %, not coord. / coord. |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    members = doc.get("family", {})
    for scenario, routers in doc.get("scenarios", {}).items():
        if (scenario in members) != family:
            continue
        for n in counts:
            free = routers.get(f"igw-llm-d-x{n}-nocoord")
            coord = routers.get(f"igw-llm-d-x{n}")
            if free is None and coord is None:
                continue
            p95 = (coord or {}).get("ttft_p95_median")
            base = _baseline(routers, coord)
            target = "n/a" if p95 is None or not base or n == 1 else (
                "met" if p95 <= 1.1 * base else "missed")
            shares_text = " / ".join(x for x in (_share(free), _share(coord)) if x)
            lines.append(
                f"| {scenario} | {n} | {_cell(free)} | "
                f"{_ratio((free or {}).get('ttft_p95_median'), _baseline(routers, free))} | "
                f"{_cell(coord)} | {_ratio(p95, base)} | {target} | {shares_text} |")
    return lines


def scrape_table(load: dict[str, Any]) -> list[str]:
    """The pod-side scrape load at each N (from `scrape_load`): uncoordinated replicas,
    then coordinated ones sharing scrape results when measured."""
    page = load["vllm_page"]
    lines = [
        f"{load['pods']} simulated pods, no traffic, {load['seconds']:g} s per N, scrapes "
        "every 50 ms; simulator idle (no gateway) "
        f"{100 * load['idle_simulator_core_share']:.1f} % of a core. A real vLLM renders its "
        f"page with prometheus_client: a vLLM-V1-shaped registry ({page['lines']} lines, "
        f"{page['bytes'] / 1000:.0f} kB) costs {page['us_per_scrape'] / 1000:.1f} ms of CPU "
        "per render here (last column: that at the measured rate, on each pod's API-server "
        "process).",
        "",
        "| replicas | scrapes/s per pod | shared results folded/s per pod (fallback scrapes/s) "
        "| simulator CPU (all pods) | simulator CPU per scrape | each picker's CPU "
        "| vLLM-shaped render, per pod |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [_scrape_row(f"{n}, not coordinated", run, page) for n, run in load["runs"].items()]
    lines += [_scrape_row(f"{n}, coordinated, shared", run, page)
              for n, run in load.get("shared_runs", {}).items()]
    return lines


def _scrape_row(label: str, run: dict[str, Any], page: dict[str, float]) -> str:
    per = run["simulator_us_per_scrape"]
    pickers = ", ".join(f"{100 * v:.1f} %" for v in run["picker_core_share_each"])
    render = 100 * run["scrapes_per_s_per_pod"] * page["us_per_scrape"] / 1e6
    shared = ("n/a" if "shared_used_per_s_per_pod" not in run else
              f"{run['shared_used_per_s_per_pod']:.1f} ({run['fallbacks_per_s']:.1f})")
    return (f"| {label} | {run['scrapes_per_s_per_pod']:.1f} | {shared} "
            f"| {100 * run['simulator_core_share']:.1f} % "
            f"| {'n/a' if per is None else f'{per:.0f} µs'} | {pickers} "
            f"| {render:.0f} % of a core |")


def render_markdown(doc: dict[str, Any]) -> str:
    """bench/results/replicas.md from the merged JSON."""
    parts = [
        "# Gateway replicas behind an L4 front (issue #16)",
        "",
        "`igw bench --replicas 1,2,4 ...` (bench/replicas.py): N `igw serve` replicas behind "
        "an Envoy `tcp_proxy` front that round-robins client connections (TLS passes "
        f"through), the load generator sending from {CLIENTS} clients with their own "
        "keep-alive pools; coordinated runs share state through a real redis-server. Same "
        "seeded arrivals for every configuration; repeats alternated, TTFT percentiles over "
        "all repeats' requests (model seconds); the ratios and the target compare the "
        "median of the repeats' p95. The machine has 2 cores shared with other "
        "agents' tests: figures within ~10 % of each other are within run-to-run noise.",
        "",
        *replica_table(doc),
        "",
        "Share column: the first repeat's connections per replica in % (requests in "
        "parentheses). Per-run commands and dates: replicas.json.",
    ]
    if doc.get("family"):
        parts += ["", "## A sample of the scenario family", "",
                  "`igw bench --replicas 1,2,4 --compare-coordination --family K --seed S`: "
                  "K members of the family of seed S (bench/family.py `sample`: spread over "
                  "its kinds, short enough to run live), named family-S-index, each at "
                  "time_scale 1 with its own warm-up; coordinated replicas share scrape "
                  "results (the default).", "",
                  *replica_table(doc, family=True), ""]
        parts += [f"- `{name}`: {about}" for name, about in doc["family"].items()]
    if "scrape_load" in doc:
        parts += ["", "## Pod-side scrape load", "", *scrape_table(doc["scrape_load"])]
    return "\n".join(parts) + "\n"


# vLLM V1's own families (vllm/v1/metrics/loggers.py): the simulator writes its page with
# f-strings, a real vLLM renders a prometheus_client registry on every scrape
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
VLLM_COUNTERS = ("num_preemptions", "prompt_tokens", "generation_tokens",
                 "prefix_cache_queries", "prefix_cache_hits", "request_success")
VLLM_HISTOGRAMS = (
    "iteration_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n",
    "request_params_max_tokens")
VLLM_BUCKETS = tuple(0.001 * 2 ** i for i in range(18))


def prometheus_client_page_us(rounds: int = 400) -> dict[str, float]:
    """CPU µs per render of a vLLM-V1-shaped page by prometheus_client (what a real pod's
    API server spends per scrape, a lower bound: no multiprocess collector), and its size."""
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        ProcessCollector,
        generate_latest,
    )

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    labels = {"model_name": "llama-3.1-8b", "engine": "0"}
    for name in VLLM_GAUGES:
        Gauge(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).set(3)
    for name in VLLM_COUNTERS:
        Counter(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).inc(7)
    for name in VLLM_HISTOGRAMS:
        hist = Histogram(f"vllm:{name}", name, list(labels), buckets=VLLM_BUCKETS,
                         registry=registry).labels(**labels)
        for value in (0.002, 0.03, 0.4, 5.0):
            hist.observe(value)
    page = generate_latest(registry)
    t0 = time.process_time()
    for _ in range(rounds):
        generate_latest(registry)
    return {"us_per_scrape": round(1e6 * (time.process_time() - t0) / rounds, 1),
            "lines": page.count(b"\n"), "bytes": len(page)}
