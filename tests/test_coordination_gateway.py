"""Two real gateways (`igw serve`) sharing one real redis-server, under load.

Redis is killed and restarted while requests flow through both: no request
fails, both pickers count a reconnect and fold each other's traffic again
afterwards; `igw status` shows the link. The pods' scrapes are shared: each
pod is scraped by one of the two, the other folds its results.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

from igw.admin_client import format_coordination, status
from tests.docker_env import METRICS_MODULE, defined_series, exposed
from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_coordination_support import redis_server
from tests.test_reliability_support import Load, chat_body, picker_metrics, wait_for

MODEL = "llama-3.1-8b"
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(3)]
RATE = 40.0  # requests/s per gateway
DURATION = 9.0


def _coordination(gw) -> dict:
    return status(gw.admin)["coordination"]


def test_redis_killed_and_restarted_under_load_fails_no_request(tmp_path):
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        fleet = stack.enter_context(sim_fleet(tmp_path, PODS, time_scale=2.0))
        coordination = {"url": redis.url, "heartbeatInterval": "250ms", "replicaTimeout": "2s"}
        schedulers = [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}]
        gws = [
            stack.enter_context(
                gateway(tmp_path, gateway_config(schedulers, coordination=coordination))
            )
            for _ in range(2)
        ]
        wait_for(lambda: all(_coordination(g)["peers"] for g in gws), 15, "peers seen")
        loads = [
            Load(g.url, g.ca, rate=RATE, duration=DURATION,
                 body=lambda i: chat_body(MODEL, f"conversation {i % 7} " * 40, max_tokens=16))
            .in_thread()
            for g in gws
        ]
        time.sleep(2.5)
        redis.stop()
        wait_for(lambda: not any(_coordination(g)["connected"] for g in gws), 10, "link down")
        down = [format_coordination(_coordination(g)) for g in gws]
        time.sleep(2.0)
        redis.start()
        wait_for(lambda: all(_coordination(g)["connected"] for g in gws), 15, "reconnected")
        results = [f.result(timeout=DURATION + 40) for f in loads]
        for result in results:
            assert result.failed() == [], result.summary()
            assert len(result.outcomes) >= RATE * DURATION * 0.9, result.summary()
        assert all("DISCONNECTED" in line for line in down), down
        for g in gws:
            metrics = picker_metrics(g.ports["metrics"])
            assert metrics["igw_coordination_reconnects_total"] >= 1
            assert metrics["igw_coordination_connected"] == 1
            assert metrics["igw_coordination_events_received_total"] > 0
        # after the restart each folds the other's traffic again, and all of it ends
        wait_for(lambda: all(_coordination(g)["peers"] for g in gws), 10, "peers again")
        wait_for(lambda: all(int(_coordination(g)["remote_inflight"]) == 0 for g in gws),
                 10, "remote in-flight released")
        out = subprocess.run(
            [sys.executable, "-m", "igw.cli", "status", "--admin", gws[0].admin],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("coordination connected replica="), out.stdout
        assert " scrapes=owner:" in out.stdout.splitlines()[0], out.stdout
        # scrape sharing: between them the two own every pod once, and fold the rest
        wait_for(lambda: all(int(_coordination(g).get("scrape_fallback", 0)) == 0
                             for g in gws), 10, "no fallback scraping")
        states = [_coordination(g) for g in gws]
        assert sum(int(s.get("scrape_owner", 0)) for s in states) == len(PODS), states
        assert all(int(s.get("scrape_owner", 0)) + int(s.get("scrape_shared", 0)) == len(PODS)
                   for s in states), states
        metrics = [picker_metrics(g.ports["metrics"]) for g in gws]
        assert sum(m["igw_coordination_shared_scrapes_sent_total"] for m in metrics) > 0
        assert sum(m['igw_coordination_shared_scrapes_received_total{result="used"}']
                   for m in metrics) > 0
        # while Redis was down, whoever did not own a pod scraped it itself
        assert sum(m["igw_coordination_scrape_fallbacks_total"] for m in metrics) > 0
        # the dashboard tests read series names from gateway_metrics.py's source: a
        # coordinated picker must expose none they cannot see there
        names = {k.partition("{")[0] for m in metrics for k in m if k.startswith("igw_")}
        assert names <= exposed(defined_series(METRICS_MODULE.read_text())), names
