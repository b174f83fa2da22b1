"""The ext_proc stream state machine: [headers →] body → (wait for the end).

One gRPC stream per HTTP request, served by picker.h2_grpc. The common request
(POST to an inference path with a content-length within the limit,
igw_envoy.listener's `one_message_route`) costs one message: Envoy skips the headers and sends the
buffered body with the header values the picker reads as attributes. Any
other request starts with a headers message, which the picker may answer on
its own (model list, 404, 405, 400, 413) before the body is read. The body is
answered with the routing decision. The stream stays open until Envoy
finishes the HTTP request, so the stream's end is the request's end: that is
where in-flight accounting is closed, at no extra message cost. Everything a
client can get wrong becomes an ApiError in the director and is turned into
an ImmediateResponse here, in one place.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from bbr.request import API_PATHS
from contract import headers as hdr
from contract.errors import (
    ApiError,
    BodyTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    error_body,
    error_headers,
)
from picker.director import Decision, Director, RequestInfo
from picker.h2_grpc import Stream

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Constant answers are serialized once: the server writes raw bytes.
CONTINUE_HEADERS = ext_proc.ProcessingResponse(
    request_headers=ext_proc.HeadersResponse()
).SerializeToString()
CONTINUE_RESPONSE_HEADERS = ext_proc.ProcessingResponse(
    response_headers=ext_proc.HeadersResponse()
).SerializeToString()
_MODELS_PATHS = frozenset({"/v1/models", "/models"})
# Envoy's key for the attributes in ProcessingRequest, whatever the filter is named.
_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"


@dataclass(slots=True)
class _Headers:
    """What the picker needs from the request headers, read in one pass."""

    method: str = ""
    path: str = ""
    content_type: str | None = None
    content_encoding: str | None = None
    request_id: str = ""
    priority: str | None = None
    criticality: str | None = None
    content_length: str | None = None


def _read_headers(header_map: base_pb2.HeaderMap) -> _Headers:
    out = _Headers()
    for h in header_map.headers:
        key = h.key
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        if key == ":path":
            out.path = value.split("?", 1)[0]
        elif key == ":method":
            out.method = value
        elif key == "content-type":
            out.content_type = value
        elif key == "content-encoding":
            out.content_encoding = value
        elif key == "x-request-id":
            out.request_id = value
        elif key == hdr.PRIORITY:
            out.priority = value
        elif key == hdr.CRITICALITY:
            out.criticality = value
        elif key == "content-length":
            out.content_length = value
    return out


def _read_attributes(request: ext_proc.ProcessingRequest) -> _Headers:
    """`_read_headers` for a stream that starts with the body: the same values, from
    the attributes Envoy sent with it (contract.headers.REQUEST_ATTRIBUTES). The route
    that skips the headers message admits POST only."""
    out = _Headers(method="POST")
    for key, value in request.attributes[_ATTRIBUTES_KEY].fields.items():
        setattr(out, hdr.REQUEST_ATTRIBUTES[key], value.string_value)
    return out


def immediate(status: int, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """An ImmediateResponse, serialized: Envoy answers the client with it directly."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in headers
        ]
    )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body
        )
    ).SerializeToString()


def error_response(exc: ApiError) -> bytes:
    return immediate(exc.status, error_body(exc), error_headers(exc))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (embedded message or bytes)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@functools.lru_cache(maxsize=4096)
def _metadata_entry(key: str, value: str) -> bytes:
    """One `Struct.fields` entry `key: "value"`, serialized once per (key, value):
    map entry(1) → {key(1), Value(2) → string_value(3)}."""
    return _field(1, _field(1, key.encode()) + _field(2, _field(3, value.encode())))


# ProcessingResponse.request_body(3) → BodyResponse.response(1) → CommonResponse
# {header_mutation(2): empty, clear_route_cache(5): true}.
_ROUTE_BODY = _field(3, _field(1, _field(2, b"") + _varint(5 << 3) + b"\x01"))
_LB_NAMESPACE = _field(1, hdr.LB_METADATA_NAMESPACE.encode())


def route_response(decision: Decision) -> bytes:
    """Body answer: the routing values (header name → value) as `envoy.lb` dynamic
    metadata, and the route cache cleared so Envoy re-matches on them.

    Metadata, not a header mutation: when the route skipped the headers message
    Envoy drops header mutations in the body answer; the pool routes match the
    metadata and copy it into the `x-gateway-*` headers (igw_envoy.listener).
    The empty header mutation is there because Envoy clears the route cache
    only for an answer that has one. Assembled from cached wire fragments
    instead of building protobuf messages per request:
    ProcessingResponse.dynamic_metadata(8) → Struct{"envoy.lb": Value.struct_value(5)}.
    A test checks it parses to the message protobuf would build.
    """
    fields = b"".join([_metadata_entry(k, v) for k, v in decision.headers])
    return _ROUTE_BODY + _field(8, _field(1, _LB_NAMESPACE + _field(2, _field(5, fields))))


def extend_timeout(seconds: float) -> bytes:
    """Tell Envoy to wait longer for this stream's answer (held in admission)."""
    whole = int(seconds)
    timeout = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    return ext_proc.ProcessingResponse(override_message_timeout=timeout).SerializeToString()


class ExtProcHandler:
    """Serves envoy.service.ext_proc.v3.ExternalProcessor/Process: `stream` makes the
    per-call state machine for picker.h2_grpc; what the headers alone decide is here."""

    def __init__(self, director: Director) -> None:
        self.director = director

    def stream(self, stream: Stream) -> ExtProcStream:
        return ExtProcStream(self, stream)

    def on_headers(self, info: _Headers, end_of_stream: bool) -> bytes:
        """Everything the headers alone decide, before Envoy buffers a body for nothing:
        the model list, unknown paths (404), other methods than POST (405), a missing
        body (400), a declared length over the limit (413, without reading the body)."""
        if info.method == "GET" and info.path in _MODELS_PATHS:
            return immediate(
                200, self.director.models_body(), [("content-type", "application/json")]
            )
        path = info.path[:-1] if len(info.path) > 1 and info.path.endswith("/") else info.path
        if path not in API_PATHS:
            raise NotFound(
                f"Invalid URL (`{path[:200]}`): the gateway routes POST "
                + ", ".join(API_PATHS)
                + " and GET /v1/models."
            )
        if info.method != "POST":
            raise MethodNotAllowed(f"{info.method[:16]} {path}: only POST is accepted here.")
        if end_of_stream:
            raise InvalidRequest(f"{info.method} {path}: request body required")
        limit = self.director.config.bbr.max_request_body_bytes
        if (
            info.content_length
            and info.content_length.isdigit()
            and int(info.content_length) > limit
        ):
            raise BodyTooLarge(
                f"Request body is {info.content_length} bytes; the limit is {limit} bytes."
            )
        return CONTINUE_HEADERS


class ExtProcStream:
    """One HTTP request's ext_proc call: [headers →] body → (wait for the end).

    Driven by message callbacks from picker.h2_grpc, so the common request is
    answered synchronously inside the connection's read callback (no task, no
    future); only a request held by admission control gets a task. The call's
    end (Envoy closes it when the HTTP request is over) closes the accounting.
    """

    __slots__ = ("_admission", "_decision", "_handler", "_info", "_stream")

    def __init__(self, handler: ExtProcHandler, stream: Stream) -> None:
        self._handler = handler
        self._stream = stream
        self._info: _Headers | None = None
        self._decision: Decision | None = None
        self._admission: asyncio.Task[None] | None = None

    def on_message(self, message: bytes) -> None:
        msg = ext_proc.ProcessingRequest.FromString(message)
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_body":
                if self._decision is None and self._admission is None:
                    # No headers message: the one-message route sent them as attributes.
                    info = self._info if self._info is not None else _read_attributes(msg)
                    self._on_body(msg.request_body.body, info)
            elif kind == "request_headers":
                if self._info is None:
                    self._info = _read_headers(msg.request_headers.headers)
                    end = msg.request_headers.end_of_stream
                    answer = self._handler.on_headers(self._info, end)
                    self._stream.send(answer)
                    if answer is not CONTINUE_HEADERS:
                        self._stream.finish()
            elif kind == "response_headers" and self._decision is not None:
                self._decision.status = _status_of(msg.response_headers.headers)
                self._stream.send(CONTINUE_RESPONSE_HEADERS)
        except ApiError as exc:
            self._stream.send(error_response(exc))
            self._stream.finish()

    def _on_body(self, body: bytes, info: _Headers) -> None:
        request = RequestInfo(
            path=info.path,
            content_type=info.content_type,
            content_encoding=info.content_encoding,
            priority=info.priority,
            criticality=info.criticality,
            request_id=info.request_id,
        )
        decision = self._handler.director.route_now(body, request)
        if decision.admission_wait is None:
            self._decision = decision
            self._stream.send(route_response(decision))
            return
        self._stream.send(extend_timeout(decision.admission_wait + 1.0))
        self._admission = asyncio.get_running_loop().create_task(self._admit(decision))

    async def _admit(self, decision: Decision) -> None:
        """Wait in the pool's admission queue, then answer (or fail) the held request."""
        try:
            await self._handler.director.admit(decision)
        except ApiError as exc:
            self._stream.send(error_response(exc))
            self._stream.finish()
            return
        self._decision = decision
        self._stream.send(route_response(decision))

    def on_end(self, reset: bool) -> None:
        """Envoy closed the call: the HTTP request is over; release its accounting."""
        if self._admission is not None and not self._admission.done():
            self._admission.cancel()
        if self._decision is not None:
            self._handler.director.complete(self._decision)
            self._decision = None
        self._stream.finish()


def _status_of(header_map: base_pb2.HeaderMap) -> int:
    for h in header_map.headers:
        if h.key == ":status":
            raw = h.raw_value.decode() if h.raw_value else h.value
            return int(raw) if raw.isdigit() else 0
    return 0
