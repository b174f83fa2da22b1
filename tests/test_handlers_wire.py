"""The handler against real ext_proc protobuf messages: the hand-assembled body answer is
exactly the message protobuf would build, and a stream that starts with the body (the
one-message route) is read and routed like one that starts with the headers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from contract import headers as hdr
from picker.director import RequestInfo
from picker.ext_proc_wire import CONTINUE_HEADERS, route_response
from picker.handlers import ExtProcHandler
from picker.tenants.identity import TenantDirectory

ROUTING = [
    ("x-gateway-pool", "llama"),
    ("x-gateway-destination-endpoint", "10.0.0.1:8000,10.0.0.2:8000"),
    ("x-gateway-model-name", "sql-lora" * 40),  # a value longer than 127 bytes
]


def test_route_response_wire_format() -> None:
    wire = route_response(ROUTING)
    parsed = ext_proc.ProcessingResponse.FromString(wire)
    metadata = struct_pb2.Struct()
    metadata.update({hdr.LB_METADATA_NAMESPACE: dict(ROUTING)})
    expected = ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(
                header_mutation=ext_proc.HeaderMutation(), clear_route_cache=True
            )
        ),
        dynamic_metadata=metadata,
    )
    assert parsed == expected
    # Envoy clears the route cache only when the answer has a header mutation.
    assert parsed.request_body.response.HasField("header_mutation")


class FakeDirector:
    """Records what the handler hands over and routes every body to ROUTING."""

    def __init__(self) -> None:
        self.infos: list[RequestInfo] = []
        self.completed = 0
        self.abandoned = 0
        self.tenants = TenantDirectory()
        self.config = SimpleNamespace(bbr=SimpleNamespace(max_request_body_bytes=1024))

    def route_now(self, body: bytes, info: RequestInfo) -> SimpleNamespace:
        self.infos.append(info)
        return SimpleNamespace(headers=ROUTING, admission_wait=None, limit_headers=None)

    def complete(self, _decision: object) -> None:
        self.completed += 1

    def abandon(self, _decision: object) -> None:
        self.abandoned += 1


class FakeStream:
    """The server side of one call (picker.h2_grpc.Stream): records what is sent."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.finished = False

    def send(self, answer: bytes) -> None:
        assert not self.finished
        self.written.append(answer)

    def finish(self, status: int = 0, message: str = "") -> None:
        self.finished = True


BODY = b'{"model": "llama", "prompt": "hi"}'
HEADERS = {
    ":method": "POST",
    ":path": "/v1/completions?api-version=1",
    "content-type": "application/json",
    "content-length": str(len(BODY)),
    "x-request-id": "rid-1",
    hdr.PRIORITY: "5",
    hdr.CRITICALITY: "critical",
}


def _header_map(values: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )


def _attributes(values: dict[str, str]) -> dict[str, struct_pb2.Struct]:
    """What Envoy 1.40 sends for the configured attributes: present headers only."""
    evaluated = {
        "request.url_path": values[":path"].split("?")[0],
        "request.id": values["x-request-id"],
    }
    for expression in (*hdr.REQUEST_ATTRIBUTES, *hdr.TENANT_ATTRIBUTES):
        name = expression.removeprefix("request.headers['").removesuffix("']")
        if name != expression and name in values:
            evaluated[expression] = values[name]
    attributes = struct_pb2.Struct()
    attributes.update(evaluated)
    return {"envoy.filters.http.ext_proc": attributes}


def _run(messages: list[ext_proc.ProcessingRequest]) -> tuple[FakeDirector, FakeStream]:
    """Feed the wire bytes (as Envoy sends them) to one call, then end it."""
    director = FakeDirector()
    stream = FakeStream()
    call = ExtProcHandler(director).stream(stream)
    for message in messages:
        call.on_message(message.SerializeToString())
    call.on_end(reset=False)
    assert stream.finished
    return director, stream


def _body(**extra: object) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=BODY, end_of_stream=True), **extra
    )


def test_body_first_stream_is_routed_like_headers_then_body() -> None:
    two = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=_header_map(HEADERS))
        ),
        _body(),
    ]
    director2, context2 = _run(two)
    director1, context1 = _run([_body(attributes=_attributes(HEADERS))])
    assert context2.written == [CONTINUE_HEADERS, route_response(ROUTING)]
    assert context1.written == context2.written[1:]  # one message, the same answer
    assert director1.infos == director2.infos
    assert director1.infos[0] == RequestInfo(
        path="/v1/completions",
        content_type="application/json",
        content_encoding=None,
        priority="5",
        criticality="critical",
        request_id="rid-1",
    )
    assert director1.completed == director2.completed == 1


def test_tenant_credentials_arrive_as_attributes_or_headers() -> None:
    tenant = {**HEADERS, "authorization": "Bearer igw_x", "x-gateway-tenant": "team-a"}
    director2, _ = _run(
        [ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=_header_map(tenant))), _body()]
    )
    director1, _ = _run([_body(attributes=_attributes(tenant))])
    assert director1.infos == director2.infos
    info = director1.infos[0]
    assert (info.authorization, info.tenant_claim) == ("Bearer igw_x", "team-a")


def test_per_request_metadata_is_encoded_like_the_cached_entries() -> None:
    extra = [("x-ratelimit-remaining-requests", "41")]
    wire = route_response(ROUTING, extra)
    assert wire == route_response(ROUTING + extra)
    assert ext_proc.ProcessingResponse.FromString(wire).dynamic_metadata.fields[
        "envoy.lb"].struct_value.fields["x-ratelimit-remaining-requests"].string_value == "41"


def test_absent_headers_are_absent_attributes() -> None:
    minimal = {":path": "/v1/completions", "x-request-id": "rid-2"}
    director, _ = _run([_body(attributes=_attributes(minimal))])
    assert director.infos == [RequestInfo(path="/v1/completions", request_id="rid-2")]


def _headers_message(values: dict[str, str], end: bool = False) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=_header_map(values), end_of_stream=end)
    )


def test_error_from_the_headers_is_answered_and_ends_the_call() -> None:
    director, stream = _run([_headers_message({**HEADERS, ":path": "/v1/nope"})])
    answer = ext_proc.ProcessingResponse.FromString(stream.written[0])
    assert answer.immediate_response.status.code == 404
    assert len(stream.written) == 1
    assert director.infos == [] and director.completed == 0


def test_response_headers_status_is_recorded() -> None:
    director = FakeDirector()
    stream = FakeStream()
    call = ExtProcHandler(director).stream(stream)
    call.on_message(_body(attributes=_attributes(HEADERS)).SerializeToString())
    decision = call._decision
    response = ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=_header_map({":status": "503"}))
    )
    call.on_message(response.SerializeToString())
    assert decision.status == 503
    call.on_end(reset=True)
    assert director.completed == 1 and stream.finished


class HeldDirector(FakeDirector):
    """A saturated pool: every request waits in admission until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.admitted = 0

    def route_now(self, body: bytes, info: RequestInfo) -> SimpleNamespace:
        self.infos.append(info)
        return SimpleNamespace(headers=ROUTING, admission_wait=2.0, status=0, limit_headers=None)

    async def admit(self, _decision: object) -> None:
        await self.release.wait()
        self.admitted += 1


async def test_admission_wait_extends_the_timeout_then_routes() -> None:
    director = HeldDirector()
    stream = FakeStream()
    call = ExtProcHandler(director).stream(stream)
    call.on_message(_body(attributes=_attributes(HEADERS)).SerializeToString())
    first = ext_proc.ProcessingResponse.FromString(stream.written[0])
    assert first.override_message_timeout.seconds == 3
    director.release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert stream.written[1] == route_response(ROUTING)
    call.on_end(reset=False)
    assert director.completed == 1 and stream.finished


async def test_call_ended_while_held_cancels_admission_and_counts_nothing() -> None:
    director = HeldDirector()
    stream = FakeStream()
    call = ExtProcHandler(director).stream(stream)
    call.on_message(_body(attributes=_attributes(HEADERS)).SerializeToString())
    await asyncio.sleep(0)
    call.on_end(reset=True)
    director.release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert director.admitted == 0 and director.completed == 0
    assert director.abandoned == 1  # its limiter grant (if any) is released
    assert len(stream.written) == 1 and stream.finished
