"""The rendered bootstrap under real traffic: a real Envoy 1.40, a stand-in picker, echo pods.

The stand-in picker (grpc.aio, xds-protos stubs) does what the real one
does on the wire: answers the headers message (when the route sends one),
then on the buffered body puts `x-gateway-pool` and
`x-gateway-destination-endpoint` into `envoy.lb` dynamic metadata and clears
the route cache, or sends an immediate response. What it does is driven by
the request body (a `test` object), so each test states its own picker
decision. Upstream "pods" are
aiohttp servers that say who served the request.

Every Envoy and server is started on free loopback ports and stopped by PID
(or closed) at the end of the module, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from contract import headers as hdr
from contract.config import parse_config
from igw.ports import free_port
from igw_envoy import (
    EnvoyProcess,
    cluster_name,
    read_endpoints,
    write_bootstrap,
    write_endpoints,
)
from igw_envoy.tls import generated_files, issue_server_cert, load_ca
from picker.ext_proc_wire import read_headers
from tests.jwt_keys import es256_token, jwks

try:
    import h2  # noqa: F401  (httpx needs it for HTTP/2)

    HAVE_H2 = True
except ImportError:
    HAVE_H2 = False

BODY_LIMIT = 8 * 1024 * 1024
POD_NAME = web.AppKey("pod_name", str)
POLL_S = 0.05


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `check` until true; returns seconds taken, fails the test after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# --- stand-in picker -------------------------------------------------------


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def picker_instructions(body: bytes) -> dict:
    """The `test` object of a request body: what the stand-in picker should do."""
    try:
        spec = json.loads(body or b"{}").get("test", {})
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def decide(test: dict) -> pb.ProcessingResponse:
    """The picker's answer to a buffered body: `{"test": {"pool", "dest", "immediate"}}`."""
    immediate = test.get("immediate")
    if immediate:
        content_type = immediate.get("content_type", "application/json")
        sets = [_set_header("content-type", content_type)] if content_type else []
        return pb.ProcessingResponse(
            immediate_response=pb.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=immediate["status"]),
                body=json.dumps(immediate["body"]).encode(),
                headers=pb.HeaderMutation(set_headers=sets),
                details=immediate.get("details", ""),
            )
        )
    values = {}
    if test.get("pool"):
        values[hdr.POOL] = test["pool"]
        values[hdr.MODEL_NAME] = test.get("model", test["pool"])
    if test.get("dest"):
        values[hdr.DESTINATION_ENDPOINT] = test["dest"]
    if not values:
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    metadata = struct_pb2.Struct()
    metadata.update({hdr.LB_METADATA_NAMESPACE: values})
    # The (empty) header mutation makes Envoy honour clear_route_cache.
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(), clear_route_cache=True)
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
    )


class StandInPicker(pb_grpc.ExternalProcessorServicer):
    """Headers → continue; body → `decide`. Keeps each stream's first message (the
    one-message route starts with the body), and what it was asked about: the path of every
    header message and the `tag` of every body's instructions. Tests that check the picker
    was not asked look for their own request there rather than count streams, because a
    stream Envoy opened for an earlier test's request can reach this server late."""

    def __init__(self) -> None:
        self.first: list[pb.ProcessingRequest] = []
        self.paths: list[str] = []
        self.tags: list[str] = []

    async def Process(self, request_iterator, context):
        first = True
        async for request in request_iterator:
            if first:
                self.first.append(request)
                first = False
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                self.paths.append(read_headers(request.request_headers.headers).path)
                if request.request_headers.end_of_stream:
                    yield decide({})  # no body will come: decide on headers alone
                    continue
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                test = picker_instructions(request.request_body.body)
                self.tags.append(str(test.get("tag", "")))
                if test.get("sleep_s"):
                    await asyncio.sleep(test["sleep_s"])
                yield decide(test)


# --- echo pods and the background loop -------------------------------------


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    name = request.app[POD_NAME]
    payload = {
        "served_by": name,
        "length": len(body),
        "destination_header": request.headers.get(hdr.DESTINATION_ENDPOINT),
    }
    return web.json_response(payload, headers={"x-served-by": name})


@dataclass
class Servers:
    """A loop in a thread hosting the picker and the echo pods, so tests stay synchronous."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    thread: threading.Thread | None = None
    runners: list[web.AppRunner] = field(default_factory=list)
    grpc_server: grpc.aio.Server | None = None
    picker: StandInPicker = field(default_factory=StandInPicker)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def add_pod(self, name: str, port: int) -> None:
        self.run(self._add_pod(name, port))

    async def _add_pod(self, name: str, port: int) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[POD_NAME] = name
        app.router.add_route("*", "/{tail:.*}", _echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)

    def serve_json(self, port: int, document: dict) -> None:
        """A tiny HTTP server answering every GET with `document` (a JWKS endpoint)."""
        self.run(self._serve_json(port, document))

    async def _serve_json(self, port: int, document: dict) -> None:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response(document)

        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)

    def start_picker(self, port: int) -> None:
        self.run(self._start_picker(port))

    async def _start_picker(self, port: int) -> None:
        # A buffered body travels in one gRPC message: the default 4 MiB
        # receive limit would fail every larger prompt (the real picker must
        # raise it to the body limit too).
        limit = BODY_LIMIT + 64 * 1024
        self.grpc_server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, self.grpc_server)
        self.grpc_server.add_insecure_port(f"127.0.0.1:{port}")
        await self.grpc_server.start()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=5)

    async def _stop(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=0)
        for runner in self.runners:
            await runner.cleanup()


# --- gateway fixtures ------------------------------------------------------


@dataclass
class Gateway:
    """One running Envoy and what a test needs to talk to it."""

    envoy: EnvoyProcess
    state_dir: Path
    port: int
    admin_port: int
    access_log: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        ca = generated_files(self.state_dir).ca_cert
        assert ca is not None
        return ca

    def client(self, http2: bool = False) -> httpx.Client:
        """A client that trusts only the gateway's generated CA."""
        verify = ssl.create_default_context(cafile=str(self.ca))
        return httpx.Client(base_url=self.url, verify=verify, http2=http2, timeout=10.0)

    def members(self, pool: str) -> set[str]:
        """Hosts Envoy currently has in a pool's cluster (admin /clusters)."""
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=2).text
        prefix = f"{cluster_name(pool)}::"
        return {
            line.split("::")[1]
            for line in text.splitlines()
            if line.startswith(prefix) and "::health_flags::" in line
        }

    def log_entry(self, request_id: str, timeout_s: float = 5.0) -> dict:
        """The access-log line of one request (Envoy runs with a 100 ms log flush here)."""
        found: list[dict] = []

        def check() -> bool:
            if self.access_log.exists():
                for line in self.access_log.read_text().splitlines():
                    entry = json.loads(line)
                    if entry["request_id"] == request_id:
                        found.append(entry)
                        return True
            return False

        wait_until(check, timeout_s, f"access log line for {request_id}")
        return found[0]


def gateway_config(
    pools: dict[str, list[str]],
    *,
    picker_port: int,
    failure_mode: str = "closed",
    extra_spec: dict | None = None,
) -> dict:
    schedulers = [
        {"name": name, "modelName": f"model-{name}", "endpoints": endpoints}
        for name, endpoints in pools.items()
    ]
    spec = {
        "tls": {},
        "bbr": {"enabled": len(pools) > 1, "maxRequestBodyBytes": BODY_LIMIT},
        "failureMode": failure_mode,
        "maxFallbacks": 2,
        "listener": {"address": "127.0.0.1", "port": free_port()},
        "ports": {
            "picker": picker_port,
            "envoyAdmin": free_port(),
            "admin": free_port(),
            "metrics": free_port(),
        },
        "schedulers": schedulers,
        **(extra_spec or {}),
    }
    return {
        "apiVersion": "inference.sagemaker.aws.amazon.com/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "test"},
        "spec": spec,
    }


@contextlib.contextmanager
def running_gateway(tmp: Path, document: dict) -> Iterator[Gateway]:
    """Render, start, yield, and always stop one Envoy."""
    config = parse_config(document)
    state = tmp / "state"
    access_log = tmp / "access.log"
    bootstrap = write_bootstrap(config, state, access_log=str(access_log))
    envoy = EnvoyProcess(
        bootstrap,
        config.envoy_admin_port,
        log_path=tmp / "envoy.log",
        extra_args=("--file-flush-interval-msec", "100"),
    )
    try:
        envoy.start()
        yield Gateway(envoy, state, config.listen_port, config.envoy_admin_port, access_log)
    finally:
        envoy.stop()


@dataclass
class Fleet:
    """The stand-in picker and three echo pods (A, B, C), plus a port nobody listens on."""

    servers: Servers
    picker_port: int
    pods: dict[str, str]
    dead: str

    def __getitem__(self, name: str) -> str:
        return self.pods[name]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    servers = Servers()
    servers.start()
    try:
        picker_port = free_port()
        servers.start_picker(picker_port)
        pods = {}
        for name in "ABC":
            port = free_port()
            servers.add_pod(name, port)
            pods[name] = f"127.0.0.1:{port}"
        yield Fleet(servers, picker_port, pods, f"127.0.0.1:{free_port()}")
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Fail-closed, picker up; pools a (A, B), b (C) and r (dead first, then B) for retries."""
    pools = {"a": [fleet["A"], fleet["B"]], "b": [fleet["C"]], "r": [fleet.dead, fleet["B"]]}
    document = gateway_config(pools, picker_port=fleet.picker_port)
    with running_gateway(tmp_path_factory.mktemp("main"), document) as gw:
        yield gw


def chat(test: dict, **extra: Any) -> dict:
    """An OpenAI-ish request body carrying the stand-in picker's instructions."""
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "test": test, **extra}


# --- routing ----------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_request_reaches_the_picked_pod(gateway: Gateway, fleet: Fleet, http2: bool) -> None:
    if http2 and not HAVE_H2:
        pytest.skip("h2 package not installed (httpx[http2])")
    with gateway.client(http2=http2) as client:
        for pod in ("A", "B"):
            resp = client.post("/v1/chat/completions", json=chat({"pool": "a", "dest": fleet[pod]}))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-served-by"] == pod
            assert resp.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        resp = client.post("/v1/chat/completions", json=chat({"pool": "b", "dest": fleet["C"]}))
        assert resp.headers["x-served-by"] == "C"


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_common_request_is_one_message_carrying_the_header_values(
    gateway: Gateway, fleet: Fleet, http2: bool
) -> None:
    """POST + inference path + content-length: the picker's stream starts with the body,
    which carries what the picker reads from the headers as attributes."""
    if http2 and not HAVE_H2:
        pytest.skip("h2 package not installed (httpx[http2])")
    picker = fleet.servers.picker
    before = len(picker.first)
    with gateway.client(http2=http2) as client:
        resp = client.post(
            "/v1/chat/completions?api-version=1",
            json=chat({"pool": "b", "dest": fleet["C"]}),
            headers={hdr.PRIORITY: "3"},
        )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-served-by"] == "C"
    assert resp.json()["destination_header"] == fleet["C"]  # copied from the metadata
    (first,) = picker.first[before:]
    assert first.WhichOneof("request") == "request_body"
    attributes = json_format.MessageToDict(first.attributes["envoy.filters.http.ext_proc"])
    assert attributes == {
        "request.url_path": "/v1/chat/completions",
        "request.id": resp.headers["x-request-id"],
        "request.headers['content-type']": "application/json",
        f"request.headers['{hdr.PRIORITY}']": "3",
    }


def test_chunked_body_takes_the_two_message_path(gateway: Gateway, fleet: Fleet) -> None:
    picker = fleet.servers.picker
    before = len(picker.first)
    body = json.dumps(chat({"pool": "a", "dest": fleet["B"]})).encode()
    with gateway.client() as client:
        resp = client.post("/v1/chat/completions", content=iter([body]))  # no content-length
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-served-by"] == "B"
    (first,) = picker.first[before:]
    assert first.WhichOneof("request") == "request_headers"
    assert picker.paths[-1] == "/v1/chat/completions"


def test_client_destination_header_never_wins(gateway: Gateway, fleet: Fleet) -> None:
    admin = f"127.0.0.1:{gateway.admin_port}"
    with gateway.client() as client:
        for forged in (fleet["B"], fleet["C"], admin):
            resp = client.post(
                "/v1/chat/completions",
                json=chat({"pool": "a", "dest": fleet["A"]}),
                headers={hdr.DESTINATION_ENDPOINT: forged, hdr.POOL: "b"},
            )
            assert resp.status_code == 200
            assert resp.headers["x-served-by"] == "A"
            assert resp.json()["destination_header"] == fleet["A"]


def test_no_destination_falls_back_to_least_request_over_members(
    gateway: Gateway, fleet: Fleet
) -> None:
    admin = f"127.0.0.1:{gateway.admin_port}"
    served = []
    with gateway.client() as client:
        for i in range(24):
            forged = (fleet["B"], fleet["C"], admin)[i % 3]
            resp = client.post(
                "/v1/chat/completions",
                json=chat({"pool": "a"}),
                headers={hdr.DESTINATION_ENDPOINT: forged},
            )
            assert resp.status_code == 200, resp.text
            # The client's copy was stripped before it could reach anything.
            assert resp.json()["destination_header"] is None
            served.append(resp.headers["x-served-by"])
    assert set(served) == {"A", "B"}  # only members, and not pinned to the forged one


def test_dead_first_in_list_is_retried_on_the_next(gateway: Gateway, fleet: Fleet) -> None:
    with gateway.client() as client:
        resp = client.post(
            "/v1/chat/completions",
            json=chat({"pool": "r", "dest": f"{fleet.dead},{fleet['B']}"}),
        )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-served-by"] == "B"
    entry = gateway.log_entry(resp.headers["x-request-id"])
    assert entry["attempts"] == 2
    assert entry["upstream_host"] == fleet["B"]
    assert entry["model"] == "r"


def test_eds_file_rewrite_takes_effect_quickly(gateway: Gateway, fleet: Fleet) -> None:
    eds_dir = gateway.state_dir / "eds"
    try:
        write_endpoints(eds_dir, cluster_name("a"), [fleet["A"], fleet["B"], fleet["C"]])
        assert wait_until(lambda: fleet["C"] in gateway.members("a"), 3, "C added") < 2.0
        with gateway.client() as client:
            resp = client.post("/v1/x", json=chat({"pool": "a", "dest": fleet["C"]}))
            assert resp.headers["x-served-by"] == "C"
            write_endpoints(eds_dir, cluster_name("a"), [fleet["A"], fleet["B"]])
            assert wait_until(lambda: fleet["C"] not in gateway.members("a"), 3, "C gone") < 2.0
            resp = client.post("/v1/x", json=chat({"pool": "a", "dest": fleet["C"]}))
            assert resp.status_code == 200
            assert resp.headers["x-served-by"] in {"A", "B"}  # no longer a member
    finally:
        write_endpoints(eds_dir, cluster_name("a"), [fleet["A"], fleet["B"]])
    assert read_endpoints(eds_dir, cluster_name("a")) == [fleet["A"], fleet["B"]]


def test_empty_pool_is_503_json_with_retry_after(gateway: Gateway, fleet: Fleet) -> None:
    eds_dir = gateway.state_dir / "eds"
    try:
        write_endpoints(eds_dir, cluster_name("b"), [])
        wait_until(lambda: not gateway.members("b"), 3, "pool b empty")
        with gateway.client() as client:
            resp = client.post("/v1/x", json=chat({"pool": "b", "dest": fleet["C"]}))
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"] == {
            "message": "no healthy upstream",
            "type": "server_error",
            "code": "service_unavailable",
        }
    finally:
        write_endpoints(eds_dir, cluster_name("b"), [fleet["C"]])
        wait_until(lambda: fleet["C"] in gateway.members("b"), 3, "pool b restored")


# --- bodies -----------------------------------------------------------------


def _big_body(test: dict, size: int) -> bytes:
    return json.dumps(chat(test, pad="x" * size)).encode()


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_several_mib_body_under_the_limit_passes(
    gateway: Gateway, fleet: Fleet, http2: bool
) -> None:
    if http2 and not HAVE_H2:
        pytest.skip("h2 package not installed (httpx[http2])")
    body = _big_body({"pool": "a", "dest": fleet["B"]}, 5 * 1024 * 1024)
    with gateway.client(http2=http2) as client:
        resp = client.post("/v1/chat/completions", content=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["length"] == len(body)


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_body_over_the_limit_is_413_json(gateway: Gateway, http2: bool) -> None:
    if http2 and not HAVE_H2:
        pytest.skip("h2 package not installed (httpx[http2])")
    with gateway.client(http2=http2) as client:
        resp = client.post("/v1/chat/completions", content=b"x" * (BODY_LIMIT + 1))
    assert resp.status_code == 413
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_too_large"
    assert str(BODY_LIMIT) in error["message"]


# --- replies ----------------------------------------------------------------


def test_picker_immediate_response_is_passed_through_untouched(gateway: Gateway) -> None:
    body = {"error": {"message": "all pods busy", "type": "rate_limit_error", "code": "busy"}}
    with gateway.client() as client:
        resp = client.post(
            "/v1/chat/completions", json=chat({"immediate": {"status": 429, "body": body}})
        )
    assert resp.status_code == 429
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == body


def test_openai_client_reads_gateway_errors(gateway: Gateway) -> None:
    openai = pytest.importorskip("openai")
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=str(gateway.ca)))
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key="unused", http_client=http_client, max_retries=0
    )
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]
        )
    assert raised.value.status_code == 413
    assert "gateway limit" in raised.value.message
    http_client.close()


def test_healthz_is_answered_by_envoy(gateway: Gateway, fleet: Fleet) -> None:
    with gateway.client() as client:
        resp = client.get("/healthz")
    assert resp.status_code == 200
    assert "/healthz" not in fleet.servers.picker.paths  # ext_proc disabled on this route


def test_slow_picker_becomes_503_after_message_timeout(gateway: Gateway) -> None:
    start = time.monotonic()
    with gateway.client() as client:
        resp = client.post("/v1/chat/completions", json=chat({"pool": "a", "sleep_s": 3}))
    assert 1.5 < time.monotonic() - start < 3.5
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "picker_unavailable"


def test_access_log_is_one_json_line_per_request(gateway: Gateway, fleet: Fleet) -> None:
    with gateway.client() as client:
        resp = client.post("/v1/chat/completions", json=chat({"pool": "b", "dest": fleet["C"]}))
    entry = gateway.log_entry(resp.headers["x-request-id"])
    assert entry["status"] == 200
    assert entry["method"] == "POST"
    assert entry["path"] == "/v1/chat/completions"
    assert entry["model"] == "b"
    assert entry["upstream_host"] == fleet["C"]
    assert entry["response_flags"] == "-"
    assert isinstance(entry["duration_ms"], int)


# --- TLS --------------------------------------------------------------------


def _served_serial(gateway: Gateway) -> int:
    context = ssl.create_default_context(cafile=str(gateway.ca))
    with (
        socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_certificate_reloads_without_restart(gateway: Gateway) -> None:
    pid = gateway.envoy.pid
    files = generated_files(gateway.state_dir)
    ca = load_ca(gateway.state_dir)
    assert ca is not None
    old = _served_serial(gateway)
    new = issue_server_cert(files, ca, ("localhost", "127.0.0.1")).serial_number
    assert new != old
    wait_until(lambda: _served_serial(gateway) == new, 3, "the new certificate to be served")
    assert gateway.envoy.pid == pid


def _handshake(gateway: Gateway, context: ssl.SSLContext) -> str:
    """Negotiated cipher name, or raises ssl.SSLError when the gateway refuses."""
    with (
        socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname="localhost") as tls,
    ):
        return tls.cipher()[0]


def _tls12_context(gateway: Gateway, ciphers: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(gateway.ca))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(ciphers)
    return context


def test_tls_policy_modern_suites_only(gateway: Gateway) -> None:
    good = _tls12_context(gateway, "ECDHE-ECDSA-AES128-GCM-SHA256")
    assert _handshake(gateway, good) == "ECDHE-ECDSA-AES128-GCM-SHA256"
    with pytest.raises(ssl.SSLError, match="HANDSHAKE_FAILURE"):  # the gateway's alert
        _handshake(gateway, _tls12_context(gateway, "ECDHE-ECDSA-AES128-SHA:@SECLEVEL=0"))
    old = ssl.create_default_context(cafile=str(gateway.ca))
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client offer TLS 1.1 at all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION"):
        _handshake(gateway, old)


# --- picker down ------------------------------------------------------------


def test_picker_down_fail_closed_is_a_fast_503(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    document = gateway_config({"a": [fleet["A"]]}, picker_port=free_port())
    with running_gateway(tmp_path_factory.mktemp("closed"), document) as gw, gw.client() as client:
        start = time.monotonic()
        resp = client.post("/v1/chat/completions", json=chat({}))
        elapsed = time.monotonic() - start
    assert resp.status_code == 503
    assert elapsed < 1.0
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "picker_unavailable"


def test_picker_down_fail_open_one_pool_is_served_by_a_member(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    admin_forgery = {hdr.DESTINATION_ENDPOINT: "127.0.0.1:1"}
    document = gateway_config(
        {"a": [fleet["A"], fleet["B"]]}, picker_port=free_port(), failure_mode="open"
    )
    with running_gateway(tmp_path_factory.mktemp("open1"), document) as gw, gw.client() as client:
        for _ in range(4):
            resp = client.post("/v1/chat/completions", json=chat({}), headers=admin_forgery)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-served-by"] in {"A", "B"}


def test_picker_down_fail_open_two_pools_ignores_a_client_pool_header(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Without the early header strip, the route matched on the client's
    x-gateway-pool before any filter ran would stick (measured): the request
    would go to pool b."""
    pools = {"a": [fleet["A"]], "b": [fleet["C"]]}
    document = gateway_config(pools, picker_port=free_port(), failure_mode="open")
    with running_gateway(tmp_path_factory.mktemp("open2"), document) as gw, gw.client() as client:
        resp = client.post("/v1/chat/completions", json=chat({}), headers={hdr.POOL: "b"})
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "server_error"


def test_picker_down_fail_open_two_pools_routes_by_the_body_model(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Envoy reads the model from the body itself (the Lua fallback filter) and sends the
    request to that model's pool; a body without a known model is still a 503, and a
    client's copy of the fallback header decides nothing."""
    pools = {"a": [fleet["A"]], "b": [fleet["C"]]}
    document = gateway_config(pools, picker_port=free_port(), failure_mode="open")
    forged = {hdr.FALLBACK_MODEL: "model-b"}
    with running_gateway(tmp_path_factory.mktemp("open3"), document) as gw, gw.client() as client:
        for model, pod in (("model-a", "A"), ("model-b", "C"), ("model-a", "A")):
            resp = client.post("/v1/chat/completions", json=chat({}, model=model), headers=forged)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-served-by"] == pod
        chunked = client.post(  # no content-length: the two-message path
            "/v1/completions",
            content=iter([b'{"prompt": "hi", ', b'"model": "model-b"}']),
            headers={"content-type": "application/json"},
        )
        assert chunked.headers["x-served-by"] == "C"
        escaped = client.post(  # "model" inside a string value is not the key
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": '"model": "model-b"'}], "model": "x"},
            headers=forged,
        )
        assert escaped.status_code == 503, escaped.text
        resp = client.post("/v1/chat/completions", json=chat({}), headers=forged)
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "server_error"


def test_picker_answer_wins_over_the_body_model_when_fail_open(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With the picker up, the fallback filter is off on the pool routes it answers with."""
    pools = {"a": [fleet["A"]], "b": [fleet["C"]]}
    document = gateway_config(pools, picker_port=fleet.picker_port, failure_mode="open")
    with running_gateway(tmp_path_factory.mktemp("open4"), document) as gw, gw.client() as client:
        body = chat({"pool": "a", "dest": fleet["A"]}, model="model-b")
        resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-served-by"] == "A"


# --- JWT --------------------------------------------------------------------


@pytest.mark.parametrize("jwks_source", ["file", "uri"])
def test_jwt_guards_everything_but_healthz(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory, jwks_source: str
) -> None:
    tmp = tmp_path_factory.mktemp("jwt")
    key = ec.generate_private_key(ec.SECP256R1())
    jwt: dict = {"issuer": "https://issuer.test", "audiences": ["igw"]}
    if jwks_source == "file":
        jwks_file = tmp / "jwks.json"
        jwks_file.write_text(json.dumps(jwks(key)))
        jwt["jwksFile"] = str(jwks_file)
    else:  # remote_jwks through the rendered `jwks` cluster (plain http on loopback)
        port = free_port()
        fleet.servers.serve_json(port, jwks(key))
        jwt["jwksUri"] = f"http://127.0.0.1:{port}/.well-known/jwks.json"
    auth = {"jwt": jwt}
    document = gateway_config(
        {"a": [fleet["A"]]}, picker_port=fleet.picker_port, extra_spec={"auth": auth}
    )
    now = int(time.time())
    claims = {"iss": "https://issuer.test", "aud": "igw", "sub": "u", "exp": now + 600}
    good = es256_token(key, claims)
    wrong_audience = es256_token(key, {**claims, "aud": "other"})
    other_key = es256_token(ec.generate_private_key(ec.SECP256R1()), claims)
    tag = f"rejected-{jwks_source}"
    rejected = chat({"pool": "a", "dest": fleet["A"], "tag": tag})
    with running_gateway(tmp, document) as gw, gw.client() as client:
        for token in (None, "not-a-jwt", other_key):
            headers = {"authorization": f"Bearer {token}"} if token else {}
            resp = client.post("/v1/chat/completions", json=rejected, headers=headers)
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["type"] == "authentication_error"
        resp = client.post(
            "/v1/chat/completions",
            json=rejected,
            headers={"authorization": f"Bearer {wrong_audience}"},
        )
        assert resp.status_code == 403
        assert resp.json()["error"]["type"] == "permission_error"
        assert tag not in fleet.servers.picker.tags  # rejected before ext_proc
        assert client.get("/healthz").status_code == 200
        resp = client.post(
            "/v1/chat/completions",
            json=chat({"pool": "a", "dest": fleet["A"], "tag": f"accepted-{jwks_source}"}),
            headers={"authorization": f"Bearer {good}"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-served-by"] == "A"
        assert f"accepted-{jwks_source}" in fleet.servers.picker.tags
