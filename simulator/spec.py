"""The fleet spec (YAML or a dict): which pods to simulate and how.

Unknown fields are errors that name the field, so a typo never silently falls back to a
default. See docs/simulator.md for the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simulator.engine import EngineConfig
from simulator.faults import FaultError, FaultState
from simulator.metrics_text import FAMILIES, VERSIONS, PageOptions
from simulator.profiles import EngineProfile, build_profile

ENGINES = ("vllm", "sglang", "trtllm")
DEFAULT_HOST = "127.0.0.1"
POD_FIELDS = {
    "name", "gpu", "model", "engine", "port", "host", "max_loras", "lora_adapters",
    "max_num_seqs", "max_queue", "max_num_batched_tokens", "model_size", "tensor_parallel",
    "profile", "faults", "data_parallel", "metrics_version", "omit_metrics",
}
FLEET_FIELDS = {"pods", "seed", "time_scale"}


class SpecError(ValueError):
    """The fleet spec is invalid; the message names the offending field."""


@dataclass(frozen=True)
class PodSpec:
    """One simulated pod. ``port`` 0 binds a free port (read it back from the running pod)."""

    name: str
    gpu: str
    model: str
    engine: str = "vllm"
    port: int = 0
    host: str = DEFAULT_HOST
    max_loras: int = 1
    lora_adapters: tuple[str, ...] = ()
    max_num_seqs: int = 256
    max_queue: int = 1024
    max_num_batched_tokens: int = 8192
    model_size: str | None = None
    tensor_parallel: int | None = None
    profile: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] = field(default_factory=dict)
    data_parallel: int = 1
    metrics_version: str | None = None
    omit_metrics: tuple[str, ...] = ()

    def page_options(self) -> PageOptions:
        """What this pod's /metrics page writes (metrics_text.PageOptions)."""
        return PageOptions.build(self.omit_metrics, self.data_parallel, self.metrics_version)

    def build_profile(self) -> EngineProfile:
        return build_profile(self.gpu, self.model, model_size=self.model_size,
                             tensor_parallel=self.tensor_parallel, overrides=self.profile)

    def engine_config(self, profile: EngineProfile, time_scale: float = 1.0) -> EngineConfig:
        return EngineConfig(
            model=self.model, profile=profile, max_num_seqs=self.max_num_seqs,
            max_loras=self.max_loras, max_queue=self.max_queue,
            max_num_batched_tokens=self.max_num_batched_tokens, time_scale=time_scale,
        )


@dataclass(frozen=True)
class FleetSpec:
    pods: tuple[PodSpec, ...]
    seed: int = 0
    time_scale: float = 1.0


def load_fleet(path: str | Path, default_host: str = DEFAULT_HOST) -> FleetSpec:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return parse_fleet(data, default_host)


def parse_fleet(data: Any, default_host: str = DEFAULT_HOST) -> FleetSpec:
    if not isinstance(data, dict):
        raise SpecError("fleet spec must be a mapping with a 'pods' list")
    _no_unknown(data, FLEET_FIELDS, "fleet")
    pods_data = data.get("pods")
    if not isinstance(pods_data, list) or not pods_data:
        raise SpecError("pods: must be a non-empty list")
    pods = tuple(_parse_pod(p, i, default_host) for i, p in enumerate(pods_data))
    _check_unique(pods)
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpecError("seed: must be an integer")
    time_scale = data.get("time_scale", 1.0)
    if not _is_number(time_scale) or time_scale < 1.0:
        raise SpecError("time_scale: must be a number >= 1")
    return FleetSpec(pods=pods, seed=seed, time_scale=float(time_scale))


def short_form(gpus: list[str], model: str, port_base: int, engine: str = "vllm",
               loras: list[str] | None = None, max_loras: int = 1) -> dict[str, Any]:
    """The fleet dict the CLI's --gpu/--model/--port-base options stand for."""
    return {
        "pods": [
            {"name": f"pod-{i}", "gpu": gpu, "model": model, "engine": engine,
             "port": port_base + i if port_base else 0, "lora_adapters": list(loras or []),
             "max_loras": max_loras}
            for i, gpu in enumerate(gpus)
        ]
    }


def _parse_pod(data: Any, index: int, default_host: str) -> PodSpec:
    where = f"pods[{index}]"
    if not isinstance(data, dict):
        raise SpecError(f"{where}: must be a mapping")
    _no_unknown(data, POD_FIELDS, where)
    for required in ("gpu", "model"):
        if not isinstance(data.get(required), str) or not data[required]:
            raise SpecError(f"{where}.{required}: required string")
    engine = data.get("engine", "vllm")
    if engine not in ENGINES:
        raise SpecError(f"{where}.engine: must be one of {', '.join(ENGINES)}")
    adapters = data.get("lora_adapters") or []
    if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
        raise SpecError(f"{where}.lora_adapters: must be a list of names")
    pod = PodSpec(
        name=_str(data, "name", f"pod-{index}", where),
        gpu=data["gpu"],
        model=data["model"],
        engine=engine,
        port=_int(data, "port", 0, where, minimum=0),
        host=_str(data, "host", default_host, where),
        max_loras=_int(data, "max_loras", 1, where),
        lora_adapters=tuple(adapters),
        max_num_seqs=_int(data, "max_num_seqs", 256, where),
        max_queue=_int(data, "max_queue", 1024, where),
        max_num_batched_tokens=_int(data, "max_num_batched_tokens", 8192, where),
        model_size=data.get("model_size"),
        tensor_parallel=data.get("tensor_parallel"),
        profile=dict(data.get("profile") or {}),
        faults=dict(data.get("faults") or {}),
        data_parallel=_int(data, "data_parallel", 1, where),
        metrics_version=_metrics_version(data, engine, where),
        omit_metrics=_omit_metrics(data, engine, where),
    )
    if pod.data_parallel > 1 and (engine != "vllm" or pod.page_options().old_labels):
        raise SpecError(f"{where}.data_parallel: only vllm pods with the engine label write"
                        " per-rank series")
    if pod.port > 65535:
        raise SpecError(f"{where}.port: must be <= 65535")
    if pod.tensor_parallel is not None and pod.tensor_parallel not in (1, 2, 4, 8):
        raise SpecError(f"{where}.tensor_parallel: must be 1, 2, 4 or 8")
    try:
        pod.build_profile()
        FaultState().update(pod.faults)
    except (ValueError, FaultError) as e:
        raise SpecError(f"{where}: {e}") from e
    return pod


def _metrics_version(data: dict[str, Any], engine: str, where: str) -> str | None:
    version = data.get("metrics_version")
    if version is None:
        return None
    known = [name for name, v in VERSIONS.items() if v.engine == engine]
    if version not in known:
        raise SpecError(f"{where}.metrics_version: must be one of {', '.join(known) or '-'}"
                        f" for engine {engine}")
    return str(version)


def _omit_metrics(data: dict[str, Any], engine: str, where: str) -> tuple[str, ...]:
    names = data.get("omit_metrics") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SpecError(f"{where}.omit_metrics: must be a list of family names")
    unknown = sorted(set(names) - FAMILIES[engine])
    if unknown:
        raise SpecError(f"{where}.omit_metrics: {engine} pages have no {', '.join(unknown)}")
    return tuple(names)


def _check_unique(pods: tuple[PodSpec, ...]) -> None:
    names = [p.name for p in pods]
    if len(set(names)) != len(names):
        raise SpecError("pods: names must be unique")
    ports = [(p.host, p.port) for p in pods if p.port]
    if len(set(ports)) != len(ports):
        raise SpecError("pods: host:port pairs must be unique")


def _no_unknown(data: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(f"{where}: unknown field(s): {', '.join(map(str, unknown))}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _str(data: dict[str, Any], key: str, default: str, where: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.{key}: must be a non-empty string")
    return value


def _int(data: dict[str, Any], key: str, default: int, where: str, minimum: int = 1) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecError(f"{where}.{key}: must be an integer >= {minimum}")
    return value
