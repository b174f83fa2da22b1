"""`igw global serve` and `igw global up`: the Tier-2 router and its demo (docs/global.md).

`serve`: the global router process (python -m globalrouter) and its Envoy front
door (igw_envoy.global_front), supervised like `igw serve`'s picker and Envoy.

`up`: the same in front of three regions on this machine, each a real Tier-1
gateway (the children `igw serve` runs) in front of its own simulated fleet,
listening on its own loopback address (127.0.0.2-4) behind a delay proxy that
adds the region's RTT (igw.delay_proxy). The regions differ in GPUs, prices and
distance, so `cheapest-within-slo` and `fastest` place differently. Like
`igw up`, the first line printed is the https:// URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from contract.global_config import GlobalRouterConfig, load_global_config
from igw.gateway import (
    READY_TIMEOUT_S,
    _line,
    envoy_child,
    fleet_gateway,
    fleet_port_count,
    gateway_children,
    simulator_child,
    supervise,
    wait_ready,
    write_up_files,
)
from igw.ports import free_ports
from igw.supervisor import ChildSpec, Supervisor, run_until_signalled
from igw_envoy.global_front import write_global_bootstrap

DRAIN_TIMEOUT_S = 30.0
LLAMA = "llama-3.1-8b"
QWEN = "qwen3-32b"


@dataclass(frozen=True)
class DemoRegion:
    """One region of `igw global up`."""

    name: str
    address: str  # its own loopback address
    rtt_s: float  # added by its delay proxy
    residency: str
    gpus: tuple[str, ...]  # one llama pod per entry
    qwen_gpu: str | None  # a qwen pod on this GPU, or none
    prices: dict[str, float]  # per million tokens


DEMO_REGIONS = (
    DemoRegion("us-east-1", "127.0.0.2", 0.010, "us", ("h100", "h100"), "h100",
               {LLAMA: 0.30, QWEN: 0.90}),
    DemoRegion("us-west-2", "127.0.0.3", 0.070, "us", ("a100", "a100"), "a100",
               {LLAMA: 0.18, QWEN: 0.60}),
    DemoRegion("eu-west-1", "127.0.0.4", 0.090, "eu", ("a10g", "a10g"), None, {LLAMA: 0.10}),
)
DEMO_MODELS = [
    {"name": LLAMA, "policy": "cheapest-within-slo", "ttftSlo": "400ms"},
    {"name": QWEN, "policy": "fastest"},
]


def global_children(config_path: Path, state_dir: Path, port: int | None,
                    log_level: str = "INFO", drain_timeout_s: float = DRAIN_TIMEOUT_S
                    ) -> list[ChildSpec]:
    """The global router first (its Envoy's ext_proc calls it), then its Envoy."""
    config = _effective(load_global_config(config_path), port)
    envoy_yaml = write_global_bootstrap(config, state_dir)
    router = ChildSpec(
        name="globalrouter",
        argv=[sys.executable, "-m", "globalrouter", "--config", str(config_path),
              "--log-level", log_level],
        stop_timeout_s=drain_timeout_s + 5.0,
    )
    return [router, envoy_child(envoy_yaml, config.envoy_admin_port, drain_timeout_s)]


def _effective(config: GlobalRouterConfig, port: int | None) -> GlobalRouterConfig:
    return config if port is None else dataclasses.replace(config, listen_port=port)


def announce_global(config: GlobalRouterConfig, state_dir: Path, model: str | None) -> None:
    """First line: the URL. Then the CA, a request to try, and the status address."""
    url = f"https://127.0.0.1:{config.listen_port}"
    _line(url)
    ca = state_dir / "tls" / "ca.pem"
    if config.tls.certificate_file is None:
        _line(f"# self-signed CA (trust it): {ca}")
    if model is not None:
        _line(
            f"# try: curl -si --cacert {ca} {url}/v1/chat/completions "
            f"-H 'content-type: application/json' -H 'x-gateway-regions: us-east-1,eu-west-1' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", '
            f'"content": "hello"}}], "max_tokens": 16}}\''
        )
    _line(f"# regions: igw global status --http 127.0.0.1:{config.metrics_port}")


async def serve_global(config_path: Path, state_dir: Path, port: int | None,
                       drain_timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    config = _effective(load_global_config(config_path), port)
    state_dir.mkdir(parents=True, exist_ok=True)
    children = global_children(config_path, state_dir, port, drain_timeout_s=drain_timeout_s)
    return await supervise(children, config,
                           lambda: announce_global(config, state_dir, model=None))


def _region_pods(region: DemoRegion) -> list[dict]:
    pods = [{"name": f"{region.name}-llama-{i}", "gpu": gpu, "model": LLAMA, "engine": "vllm"}
            for i, gpu in enumerate(region.gpus)]
    if region.qwen_gpu is not None:
        pods.append({"name": f"{region.name}-qwen-0", "gpu": region.qwen_gpu, "model": QWEN,
                     "engine": "vllm"})
    return pods


async def regions_ready(http_port: int, count: int, deadline_s: float = READY_TIMEOUT_S) -> None:
    """Until the router says `count` regions are fresh with every pod ready: the demo's
    URL is printed when any region may take a request, not when the first one can."""
    import aiohttp

    url = f"http://127.0.0.1:{http_port}/regions"
    deadline = time.monotonic() + deadline_s
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as reply:
                    regions = (await reply.json())["regions"]
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError):
                regions = []
            ready = [r for r in regions if r["fresh"] and r["pools"]
                     and all(p["readyPods"] == p["pods"] for p in r["pools"])]
            if len(ready) == count:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("regions not ready in time")


def up_global_files(state_dir: Path, port: int) -> tuple[Path, list[ChildSpec], list[Path]]:
    """Every file of the demo; the global config's path, the region children (fleets,
    Tier-1 gateways, delay proxies) and the regions' gateway config paths."""
    children: list[ChildSpec] = []
    region_docs: list[dict] = []
    region_configs: list[Path] = []
    fleets = [_region_pods(region) for region in DEMO_REGIONS]
    # Every 127.0.0.1 port of the demo in one call, so none repeats across regions.
    local = iter(free_ports(3 + sum(fleet_port_count(pods) for pods in fleets)))
    for region, pods in zip(DEMO_REGIONS, fleets, strict=True):
        region_dir = state_dir / region.name
        fleet = {"seed": 7, "pods": pods}
        listen, proxy_port = free_ports(2, region.address)
        fleet_ports = [next(local) for _ in range(fleet_port_count(pods))]
        doc = fleet_gateway(f"igw-{region.name}", pods, region.address, listen, fleet_ports)
        fleet_path, config_path = write_up_files(region_dir, fleet, doc)
        region_configs.append(config_path)
        tier1 = gateway_children(config_path, region_dir, None)
        for spec in [simulator_child(fleet_path), *tier1]:
            spec.name = f"{region.name}/{spec.name}"
            spec.stdout_to_stderr = True  # our stdout: the URL first, then the access log
            children.append(spec)
        children.append(ChildSpec(
            name=f"{region.name}/delay-proxy",
            argv=[sys.executable, "-m", "igw.delay_proxy",
                  "--listen", f"{region.address}:{proxy_port}",
                  "--upstream", f"{region.address}:{listen}", "--rtt", str(region.rtt_s)],
            stdout_to_stderr=True,
        ))
        region_docs.append({
            "name": region.name,
            "endpoint": f"{region.address}:{proxy_port}",
            "caFile": str(region_dir / "tls" / "ca.pem"),
            "tags": {"residency": region.residency},
            "costs": {m: {"perMillionTokens": p} for m, p in region.prices.items()},
        })
    doc = {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "GlobalRouterConfig",
        "metadata": {"name": "igw-global-up"},
        "spec": {
            "regions": region_docs,
            "models": DEMO_MODELS,
            "listener": {"address": "127.0.0.1", "port": port},
            "ports": {"picker": next(local), "metrics": next(local),
                      "envoyAdmin": next(local)},
        },
    }
    global_path = state_dir / "global.yaml"
    global_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return global_path, children, region_configs


async def up_global(state_dir: Path, port: int) -> int:
    from contract.config import load_config

    state_dir.mkdir(parents=True, exist_ok=True)
    global_path, region_children, region_configs = up_global_files(state_dir, port)
    config = load_global_config(global_path)
    supervisor = Supervisor([*region_children, *global_children(global_path, state_dir, None)])

    async def ready() -> None:
        await asyncio.gather(*(wait_ready(load_config(p)) for p in region_configs))
        await wait_ready(config)
        await regions_ready(config.metrics_port, len(DEMO_REGIONS))
        announce_global(config, state_dir, model=LLAMA)
        _line(f"# config: {global_path}")

    return await run_until_signalled(supervisor, ready)
