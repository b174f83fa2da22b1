"""The `igw` command for real: `igw up` end to end, admin commands, render-envoy."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys

import httpx
import psutil
import yaml

from bench.procs import descendants, start_piped, wait_line
from igw.ports import free_port
from igw_envoy.binary import validate_config
from tests.procs import gateway, gateway_config, sim_fleet

IGW = [sys.executable, "-m", "igw.cli"]


def test_igw_up_serves_the_embedded_fleet(tmp_path):
    port = free_port()
    up = start_piped("igw up", [*IGW, "up", "--port", str(port)],
                     env={"IGW_STATE_DIR": str(tmp_path)})
    try:
        # The README's promise: the first line on stdout is the URL (no simulator line, no
        # access-log line of the readiness probe before it).
        url = wait_line(up, lambda line: bool(line.strip()), 90)
        assert url == f"https://127.0.0.1:{port}"
        ca = tmp_path / "up" / "tls" / "ca.pem"
        ctx = ssl.create_default_context(cafile=str(ca))
        with httpx.Client(base_url=url, verify=ctx, timeout=30) as c:
            models = {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert {"llama-3.1-8b", "qwen3-32b", "sql-lora"} <= models
            r = c.post("/v1/chat/completions", json={
                "model": "sql-lora", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(40) == 0
    finally:
        up.stop(timeout=15)


def test_admin_commands_status_explain_drain(tmp_path):
    pods = [{"name": f"p{i}", "gpu": "h100", "model": "m-8b", "engine": "vllm"} for i in range(2)]
    with sim_fleet(tmp_path, pods) as fleet:
        config = gateway_config(
            [{"name": "m", "modelName": "m-8b", "endpoints": fleet.addresses()}]
        )
        with gateway(tmp_path, config) as gw:
            admin = ["--admin", gw.admin]
            status = subprocess.run([*IGW, "status", *admin], capture_output=True, text=True)
            assert status.returncode == 0, status.stderr
            assert "pool m model=m-8b scheduler=llm-d" in status.stdout
            explained = subprocess.run(
                [*IGW, "explain", *admin, "--model", "m-8b", "--prompt", "hi"],
                capture_output=True, text=True,
            )
            assert explained.returncode == 0, explained.stderr
            data = json.loads(explained.stdout)
            assert data["pool"] == "m" and len(data["picked"]) == 2
            assert {"predictedLatency", "queue"} <= set(data["pods"][0]["scores"])
            target = fleet.addresses()[0]
            drained = subprocess.run([*IGW, "drain", "m", target, *admin],
                                     capture_output=True, text=True)
            assert drained.returncode == 0 and "drained" in drained.stdout
            ctx = ssl.create_default_context(cafile=str(gw.ca))
            with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as c:
                for _ in range(6):
                    r = c.post("/v1/completions",
                               json={"model": "m-8b", "prompt": "x", "max_tokens": 1})
                    assert r.status_code == 200
                    assert r.headers["x-sim-pod"] == fleet.name_of(fleet.addresses()[1])
            status = json.loads(subprocess.run([*IGW, "status", "--json", *admin],
                                               capture_output=True, text=True).stdout)
            pod = next(p for p in status[0]["pods"] if p["address"] == target)
            assert pod["draining"] is True
            subprocess.run([*IGW, "undrain", "m", target, *admin], check=True,
                           capture_output=True)


def test_render_envoy_output_validates(tmp_path):
    config = gateway_config([{"name": "a", "modelName": "a", "endpoints": ["127.0.0.1:9"]}])
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([*IGW, "render-envoy", str(path), "--state-dir", str(tmp_path / "s")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rendered = tmp_path / "envoy.yaml"
    rendered.write_text(out.stdout)
    assert "envoy.filters.http.ext_proc" in out.stdout
    # The printed config refers to TLS/SDS/EDS files a real run writes; write them, then validate.
    from contract.config import load_config
    from igw_envoy.render import write_bootstrap

    validate_config(write_bootstrap(load_config(path), tmp_path / "s"))


def test_sim_and_bench_take_their_own_options(tmp_path):
    sim = start_piped("igw sim", [*IGW, "sim", "--gpu", "h100,a10g", "--model", "m-8b",
                                  "--port-base", "0"])
    try:
        assert "simulator ready: 2 pods" in wait_line(sim, lambda line: "ready" in line, 30)
    finally:
        assert sim.stop(timeout=15) == 0
    bench = subprocess.run([*IGW, "bench", "--help"], capture_output=True, text=True)
    assert bench.returncode == 0 and "--scenario" in bench.stdout


def test_igw_global_up_serves_three_regions(tmp_path):
    """`igw global up`: the URL first, the cheapest region within the SLO answering (the
    demo's llama SLO fits every region once their speeds are learned; before that the
    nearest), the allow-list honoured, and every process stopped on SIGTERM."""
    port = free_port()
    up = start_piped("igw global up", [*IGW, "global", "up", "--port", str(port)],
                     env={"IGW_STATE_DIR": str(tmp_path)})
    try:
        url = wait_line(up, lambda line: bool(line.strip()), 120)
        assert url == f"https://127.0.0.1:{port}"
        up.drain()
        ca = tmp_path / "global-up" / "tls" / "ca.pem"
        ctx = ssl.create_default_context(cafile=str(ca))
        body = {"model": "llama-3.1-8b", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello"}]}
        with httpx.Client(base_url=url, verify=ctx, timeout=30) as c:
            models = {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert models == {"llama-3.1-8b", "qwen3-32b"}
            served = {c.post("/v1/chat/completions", json=body).headers["x-gateway-region"]
                      for _ in range(3)}
            assert served <= {"us-east-1", "us-west-2", "eu-west-1"}
            only_eu = c.post("/v1/chat/completions", json=body,
                             headers={"x-gateway-regions": "eu-west-1"})
            assert only_eu.status_code == 200 and only_eu.headers["x-gateway-region"] == "eu-west-1"
            # qwen runs in the US regions only
            qwen = c.post("/v1/chat/completions", json={**body, "model": "qwen3-32b"},
                          headers={"x-gateway-regions": "eu-west-1"})
            assert qwen.status_code == 503
        children = descendants(up.pid)
        assert len(children) >= 14  # 3 fleets, 3 x (picker, Envoy, delay proxy), router, Envoy
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert not [pid for pid in children if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        up.stop(timeout=15)
