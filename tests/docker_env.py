"""A Docker engine and registry-less images for the compose test, and the stack itself.

This machine (and CI) has no image registry and containers cannot reach the
package index, so `.ci/docker-setup` builds what a registry would give:
dockerd started if none answers, a Debian bookworm base image (debootstrap
then `docker import`), a Prometheus image from the host's Debian binary, a
Redis image from Debian's redis-server packages, and a wheelhouse of the
project's dependencies (which the Dockerfile installs offline when it finds
one in the build context). The images are cached in
Docker across runs; everything else the test creates is removed at the end.

Every wait is bounded; dockerd is stopped at the end only if this module
started it.

Also here: the gateway's metric names parsed from picker/gateway_metrics.py
(shared by the fast dashboard test and the compose test, which checks the
parse against what the running gateway exposes).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from igw.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / ".ci" / "docker-setup"
COMPOSE_FILE = ROOT / "docker-compose.yml"
BASE_IMAGE = "igw-local/python:3.11-bookworm"
PROMETHEUS_IMAGE = "igw-local/prometheus:debian"
REDIS_IMAGE = "igw-local/redis:debian"
# The CA of the certificate both gateway replicas serve (issued by tls-init).
SHARED_CA = "/etc/igw-tls/tls/ca.pem"
GATEWAYS = ("gateway-1", "gateway-2")
METRICS_MODULE = ROOT / "picker" / "gateway_metrics.py"

DOCKERD_TIMEOUT_S = 90
BASE_IMAGE_TIMEOUT_S = 900
WHEELHOUSE_TIMEOUT_S = 900
BUILD_UP_TIMEOUT_S = 900
DOWN_TIMEOUT_S = 120
READY_TIMEOUT_S = 120


class CommandError(RuntimeError):
    """A command failed; the message carries its output's tail."""


def run(
    argv: Sequence[str | Path],
    timeout: float,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run to completion with a deadline; on failure raise with the output's tail."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(f"{' '.join(argv)}: no result in {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise CommandError(f"{' '.join(argv)}: exit {proc.returncode}\n{tail}")
    return proc


def docker_cli() -> str | None:
    """Debian's docker CLI (same version as its dockerd) when present, else any on PATH."""
    return shutil.which("/usr/bin/docker") or shutil.which("docker")


def compose_cli(docker: str | None) -> list[str] | None:
    """docker-compose v1 (Debian's package) or the Compose v2 plugin, whichever exists."""
    if shutil.which("docker-compose"):
        return [str(shutil.which("docker-compose"))]
    if docker is not None:
        with contextlib.suppress(CommandError):
            run([docker, "compose", "version"], timeout=20)
            return [docker, "compose"]
    return None


def skip_reason() -> str | None:
    """Why this machine cannot run the compose test, or None."""
    if os.geteuid() != 0:
        return "needs root (starts dockerd, runs debootstrap)"
    docker = docker_cli()
    missing = [
        name
        for name, found in (
            ("docker CLI (apt-get install docker.io)", docker),
            ("dockerd (apt-get install docker.io)", shutil.which("dockerd")),
            ("docker-compose (apt-get install docker-compose)", compose_cli(docker)),
            ("debootstrap (apt-get install debootstrap)", shutil.which("debootstrap")),
            ("prometheus (apt-get install prometheus)", shutil.which("prometheus")),
        )
        if not found
    ]
    if missing:
        return "missing: " + ", ".join(missing) + " (IGW_DOCKER_TESTS=1 make system-deps)"
    return None


@dataclass
class DockerEnv:
    """What the compose test runs with; `timings` holds each set-up step's seconds."""

    docker: str
    compose: list[str]
    started_dockerd: bool
    timings: dict[str, float] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
        env.update(
            IGW_BASE_IMAGE=BASE_IMAGE,
            IGW_PROMETHEUS_IMAGE=PROMETHEUS_IMAGE,
            IGW_REDIS_IMAGE=REDIS_IMAGE,
            PYTHON=sys.executable,
        )
        env.update(extra)
        return env


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - start, 1)


@contextlib.contextmanager
def docker_environment() -> Iterator[DockerEnv]:
    """A running Docker engine, the cached base, Prometheus and Redis images, a fresh wheelhouse.

    Skips when the machine cannot have them (not root, packages missing,
    dockerd will not start); a failure after that is a test failure.
    """
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    docker, compose = docker_cli(), compose_cli(docker_cli())
    assert docker is not None and compose is not None
    timings: dict[str, float] = {}
    with _timed(timings, "dockerd"):
        started = run([SETUP, "dockerd"], timeout=DOCKERD_TIMEOUT_S, check=False)
    if started.returncode != 0:
        pytest.skip(f"dockerd cannot start here: {started.stderr.strip()[-500:]}")
    denv = DockerEnv(docker, compose, started.stdout.strip().endswith("started"), timings)
    wheelhouse = ROOT / "wheelhouse"
    created_wheelhouse = not wheelhouse.exists()
    try:
        with _timed(timings, "base_image"):
            run([SETUP, "base-image"], timeout=BASE_IMAGE_TIMEOUT_S, env=denv.env())
        with _timed(timings, "prometheus_image"):
            run([SETUP, "prometheus-image"], timeout=300, env=denv.env())
        with _timed(timings, "redis_image"):
            run([SETUP, "redis-image"], timeout=600, env=denv.env())
        with _timed(timings, "wheelhouse"):
            run([SETUP, "wheelhouse", wheelhouse], timeout=WHEELHOUSE_TIMEOUT_S, env=denv.env())
        yield denv
    finally:
        if created_wheelhouse:
            shutil.rmtree(wheelhouse, ignore_errors=True)
        if denv.started_dockerd:
            run([SETUP, "stop-dockerd"], timeout=60, check=False)


@dataclass
class ComposeStack:
    """One `docker-compose up` of docker-compose.yml under a project name of its own."""

    denv: DockerEnv
    project: str
    image: str
    https_port: int
    prometheus_port: int
    ca_file: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    def env(self) -> dict[str, str]:
        return self.denv.env(
            COMPOSE_PROJECT_NAME=self.project,
            IGW_IMAGE=self.image,
            IGW_HTTPS_PORT=str(self.https_port),
            IGW_PROMETHEUS_PORT=str(self.prometheus_port),
        )

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = [*self.denv.compose, "-f", str(COMPOSE_FILE), "-p", self.project, *args]
        return run(argv, timeout=timeout, env=self.env())

    def docker(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([self.denv.docker, *args], timeout=timeout)

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            raise CommandError(f"no container for service {service}")
        return cid

    def inspect(self, service: str) -> dict:
        return json.loads(self.docker("inspect", self.container(service)).stdout)[0]

    def logs(self, tail: int = 60) -> str:
        with contextlib.suppress(CommandError):
            return self.compose("logs", "--no-color", f"--tail={tail}").stdout
        return "(no logs)"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def prometheus_query(self, query: str) -> list[dict]:
        reply = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": query}, timeout=5)
        reply.raise_for_status()
        return reply.json()["data"]["result"]


def wait_for(what: str, probe, timeout: float, interval: float = 1.0):
    """Call `probe` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except (httpx.HTTPError, OSError, CommandError, KeyError, ValueError) as exc:
            last_error, result = exc, None
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last error: {last_error})")


def _dangling_images(docker: str) -> set[str]:
    out = run([docker, "images", "-q", "--no-trunc", "-f", "dangling=true"], timeout=30)
    return set(out.stdout.split())


def _containers(docker: str) -> set[str]:
    """Every container, running or not (a failed classic build leaves one behind)."""
    return set(run([docker, "ps", "-a", "-q", "--no-trunc"], timeout=30).stdout.split())


@contextlib.contextmanager
def compose_stack(denv: DockerEnv, workdir: Path) -> Iterator[ComposeStack]:
    """`up -d --build`, wait until the front answers with the gateways' CA, yield; then
    `down -v` and remove the image it built (the cached base images stay)."""
    project = f"igwtest{os.getpid()}"
    stack = ComposeStack(
        denv=denv,
        project=project,
        image=f"igw-test/inference-gateway:{project}",
        https_port=free_port(),
        prometheus_port=free_port(),
        ca_file=workdir / "ca.pem",
    )
    dangling_before = _dangling_images(denv.docker)
    containers_before = _containers(denv.docker)
    try:
        with _timed(denv.timings, "compose_up_build"):
            stack.compose("up", "-d", "--build", timeout=BUILD_UP_TIMEOUT_S)
        with _timed(denv.timings, "gateway_ready"):
            _wait_ready(stack)
        yield stack
    except Exception as exc:
        raise CommandError(f"{exc}\n--- compose logs ---\n{stack.logs()}") from exc
    finally:
        with _timed(denv.timings, "compose_down"):
            with contextlib.suppress(CommandError):
                stack.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=DOWN_TIMEOUT_S)
            leftover = _containers(denv.docker) - containers_before
            if leftover:
                run([denv.docker, "rm", "-f", "-v", *sorted(leftover)], timeout=120, check=False)
            with contextlib.suppress(CommandError):
                run([denv.docker, "rmi", "-f", stack.image], timeout=60)
            new = _dangling_images(denv.docker) - dangling_before
            if new:
                run([denv.docker, "rmi", "-f", *sorted(new)], timeout=120, check=False)


def _wait_ready(stack: ComposeStack) -> None:
    """Both gateway replicas and the front healthy, the shared CA copied out, HTTPS
    verified through the front's published port."""

    def healthy(service: str):
        def probe() -> bool:
            state = stack.inspect(service)["State"]
            if state["Status"] in ("exited", "dead"):
                raise AssertionError(f"{service} container {state['Status']}: {state}")
            return state.get("Health", {}).get("Status") == "healthy"

        return probe

    for service in (*GATEWAYS, "front"):
        wait_for(f"{service} container healthy", healthy(service), READY_TIMEOUT_S)
    gateway = stack.container(GATEWAYS[0])
    stack.docker("cp", f"{gateway}:{SHARED_CA}", str(stack.ca_file))

    def answers() -> bool:
        with httpx.Client(verify=stack.ssl_context(), timeout=5) as client:
            return client.get(f"{stack.url}/healthz").status_code == 200

    wait_for("HTTPS through the front on the published port", answers, 30)


# --- The gateway's metric names, parsed from picker/gateway_metrics.py ---

# prometheus_client constructors and the series each exposes for a name.
COUNTERS = {"Counter", "CounterMetricFamily"}
GAUGES = {"Gauge", "GaugeMetricFamily", "Info", "InfoMetricFamily", "Enum"}
HISTOGRAMS = {"Histogram", "HistogramMetricFamily", "Summary", "SummaryMetricFamily"}


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _string(node: ast.expr, constants: dict[str, str]) -> str | None:
    """A literal or an f-string over module constants; None if it depends on anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif (
                isinstance(value, ast.FormattedValue)
                and isinstance(value.value, ast.Name)
                and value.value.id in constants
            ):
                parts.append(constants[value.value.id])
            else:
                return None
        return "".join(parts)
    return None


def defined_series(source: str) -> dict[str, str]:
    """Every series name the module can expose → its kind (counter, gauge, histogram)."""
    tree = ast.parse(source)
    constants: dict[str, str] = {}
    pod_gauges: tuple = ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            value = node.value
            if (
                isinstance(target, ast.Name)
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                constants[target.id] = value.value
            if isinstance(target, ast.Name) and target.id == "POD_GAUGES":
                pod_gauges = ast.literal_eval(node.value)
    assert "PREFIX" in constants, "gateway_metrics.py: no PREFIX constant"
    assert pod_gauges, "gateway_metrics.py: no POD_GAUGES table"
    names: dict[str, str] = {}
    for _column, suffix, _doc in pod_gauges:
        names[f"{constants['PREFIX']}_{suffix}"] = "gauge"
    for call, scope in _calls_in_scope(tree, constants):
        kind = _call_name(call)
        if kind is None:
            continue
        for name in filter(None, (_string(call.args[0], c) for c in scope)):
            if kind in COUNTERS:
                names[name.removesuffix("_total")] = "counter"
            elif kind in GAUGES:
                names[name] = "gauge"
            elif kind in HISTOGRAMS:
                names[name] = "histogram"
    return names


def _calls_in_scope(tree: ast.Module, constants: dict[str, str]):
    """(call, the constant sets its first argument may be built from), for every call.

    Beyond module constants: a function's local strings (`name = f"{PREFIX}_x"`)
    and, inside `for suffix, ... in table:` over a local tuple of tuples whose
    first items are strings, each of those strings bound to `suffix` (how
    collectors build families from a table).
    """

    def visit(node: ast.AST, scopes: list[dict[str, str]]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            local = dict(scopes[0])
            tables: dict[str, list[str]] = {}
            for child in ast.walk(node):
                if not (isinstance(child, ast.Assign) and len(child.targets) == 1):
                    continue
                target = child.targets[0]
                if not isinstance(target, ast.Name):
                    continue
                text = _string(child.value, local)
                if text is not None:
                    local[target.id] = text
                elif isinstance(child.value, ast.Tuple | ast.List):
                    firsts = [
                        e.elts[0].value
                        for e in child.value.elts
                        if isinstance(e, ast.Tuple)
                        and e.elts
                        and isinstance(e.elts[0], ast.Constant)
                        and isinstance(e.elts[0].value, str)
                    ]
                    if firsts and len(firsts) == len(child.value.elts):
                        tables[target.id] = firsts
            for child in node.body:
                yield from visit_in(child, [local], tables)
            return
        yield from visit_in(node, scopes, {})

    def visit_in(node: ast.AST, scopes: list[dict[str, str]], tables: dict[str, list[str]]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from visit(node, scopes)
            return
        if (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Name)
            and node.iter.id in tables
            and isinstance(node.target, ast.Tuple)
            and node.target.elts
            and isinstance(node.target.elts[0], ast.Name)
        ):
            var = node.target.elts[0].id
            scopes = [{**c, var: v} for c in scopes for v in tables[node.iter.id]]
        if isinstance(node, ast.Call) and node.args:
            yield node, scopes
        for child in ast.iter_child_nodes(node):
            yield from visit_in(child, scopes, tables)

    for node in tree.body:
        yield from visit(node, [constants])


def exposed(names: dict[str, str]) -> set[str]:
    """The series names Prometheus stores for the defined metrics."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    return {name + suffix for name, kind in names.items() for suffix in suffixes[kind]}
