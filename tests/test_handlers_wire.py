"""The handler against real ext_proc protobuf messages: the hand-assembled body answer is
exactly the message protobuf would build, and a stream that starts with the body (the
one-message route) is read and routed like one that starts with the headers."""

from __future__ import annotations

from types import SimpleNamespace

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from bbr import headers as hdr
from picker.director import RequestInfo
from picker.handlers import CONTINUE_HEADERS, ExtProcHandler, route_response

ROUTING = [
    ("x-gateway-pool", "llama"),
    ("x-gateway-destination-endpoint", "10.0.0.1:8000,10.0.0.2:8000"),
    ("x-gateway-model-name", "sql-lora" * 40),  # a value longer than 127 bytes
]


def test_route_response_wire_format() -> None:
    wire = route_response(SimpleNamespace(headers=ROUTING))
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
        self.config = SimpleNamespace(bbr=SimpleNamespace(max_request_body_bytes=1024))

    def route_now(self, body: bytes, info: RequestInfo) -> SimpleNamespace:
        self.infos.append(info)
        return SimpleNamespace(headers=ROUTING, admission_wait=None)

    def complete(self, _decision: object) -> None:
        self.completed += 1


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
    for expression in hdr.REQUEST_ATTRIBUTES:
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
    assert context2.written == [CONTINUE_HEADERS, route_response(SimpleNamespace(headers=ROUTING))]
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


def test_absent_headers_are_absent_attributes() -> None:
    minimal = {":path": "/v1/completions", "x-request-id": "rid-2"}
    director, _ = _run([_body(attributes=_attributes(minimal))])
    assert director.infos == [RequestInfo(path="/v1/completions", request_id="rid-2")]
