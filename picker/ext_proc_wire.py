"""The ext_proc wire format: what the picker reads from Envoy's messages and the bytes it answers.

Kept apart from the stream state machine (picker.handlers) so that one reads as
"which message, when" and this one as "which bytes". Everything here is on the
request path: constant answers are serialized once, the body answer is
assembled from cached protobuf fragments, and incoming messages are parsed by
protobuf's own `FromString` (`parse_request` is that function, not a wrapper).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from contract import headers as hdr
from contract.errors import ApiError, error_body, error_headers

parse_request = ext_proc.ProcessingRequest.FromString

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Constant answers are serialized once: the server writes raw bytes.
CONTINUE_HEADERS = ext_proc.ProcessingResponse(
    request_headers=ext_proc.HeadersResponse()
).SerializeToString()
CONTINUE_RESPONSE_HEADERS = ext_proc.ProcessingResponse(
    response_headers=ext_proc.HeadersResponse()
).SerializeToString()
# Envoy's key for the attributes in ProcessingRequest, whatever the filter is named.
_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
# Every attribute the listener may ask for → the RequestHeaders field it fills.
_ATTRIBUTE_FIELDS = {**hdr.REQUEST_ATTRIBUTES, **hdr.TENANT_ATTRIBUTES, **hdr.GLOBAL_ATTRIBUTES}


@dataclass(slots=True)
class RequestHeaders:
    """What the picker needs from the request headers, read in one pass."""

    method: str = ""
    path: str = ""
    content_type: str | None = None
    content_encoding: str | None = None
    request_id: str = ""
    priority: str | None = None
    criticality: str | None = None
    content_length: str | None = None
    authorization: str | None = None
    tenant_claim: str | None = None
    # The global router's client allow-list of regions (contract.headers.REGIONS).
    regions: str | None = None
    # The global router's session id (contract.headers.SESSION).
    session: str | None = None


def read_headers(header_map: base_pb2.HeaderMap) -> RequestHeaders:
    out = RequestHeaders()
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
        elif key == hdr.AUTHORIZATION:
            out.authorization = value
        elif key == hdr.TENANT:
            out.tenant_claim = value
        elif key == hdr.REGIONS:
            out.regions = value
        elif key == hdr.SESSION:
            out.session = value
    return out


def read_attributes(request: ext_proc.ProcessingRequest) -> RequestHeaders:
    """`read_headers` for a stream that starts with the body: the same values, from
    the attributes Envoy sent with it (contract.headers.REQUEST_ATTRIBUTES). The route
    that skips the headers message admits POST only."""
    out = RequestHeaders(method="POST")
    for key, value in request.attributes[_ATTRIBUTES_KEY].fields.items():
        setattr(out, _ATTRIBUTE_FIELDS[key], value.string_value)
    return out


def status_of(header_map: base_pb2.HeaderMap) -> int:
    """The upstream's `:status` from a response_headers message; 0 when absent or odd."""
    for h in header_map.headers:
        if h.key == ":status":
            raw = h.raw_value.decode() if h.raw_value else h.value
            return int(raw) if raw.isdigit() else 0
    return 0


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
    """The client-visible error (contract.errors) as the ImmediateResponse Envoy sends."""
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


@functools.lru_cache(maxsize=64)
def _entry_key(key: str) -> bytes:
    return _field(1, key.encode())


def _volatile_entry(key: str, value: str) -> bytes:
    """`_metadata_entry` for a value that changes per request (a count): the key part
    is cached, and a short value (every x-ratelimit-* figure) is framed with one-byte
    lengths directly instead of through `_field`'s varints."""
    raw = value.encode()
    head = _entry_key(key)
    size = len(head) + len(raw) + 4
    if size > 127:
        return _metadata_entry.__wrapped__(key, value)
    # map entry(1) → {key, Value(2) → string_value(3)}: every length fits one byte
    return b"\x0a%c%s\x12%c\x1a%c%s" % (size, head, len(raw) + 2, len(raw), raw)


# ProcessingResponse.request_body(3) → BodyResponse.response(1) → CommonResponse
# {header_mutation(2): empty, clear_route_cache(5): true}.
_ROUTE_BODY = _field(3, _field(1, _field(2, b"") + _varint(5 << 3) + b"\x01"))
_LB_NAMESPACE = _field(1, hdr.LB_METADATA_NAMESPACE.encode())


def route_response(
    routing: list[tuple[str, str]], extra: list[tuple[str, str]] | None = None
) -> bytes:
    """Body answer: the routing values (header name → value) as `envoy.lb` dynamic
    metadata, and the route cache cleared so Envoy re-matches on them.

    Metadata, not a header mutation: when the route skipped the headers message
    Envoy drops header mutations in the body answer; the pool routes match the
    metadata and copy it into the `x-gateway-*` headers (igw_envoy.routes).
    The empty header mutation is there because Envoy clears the route cache
    only for an answer that has one. Assembled from cached wire fragments
    instead of building protobuf messages per request:
    ProcessingResponse.dynamic_metadata(8) → Struct{"envoy.lb": Value.struct_value(5)}.
    A test checks it parses to the message protobuf would build. `extra` are
    values that differ per request (a tenant's remaining limits): encoded without
    the cache, which they would only flush.
    """
    fields = b"".join([_metadata_entry(k, v) for k, v in routing])
    if extra:
        fields += b"".join([_volatile_entry(k, v) for k, v in extra])
    return _ROUTE_BODY + _field(8, _field(1, _LB_NAMESPACE + _field(2, _field(5, fields))))


def extend_timeout(seconds: float) -> bytes:
    """Tell Envoy to wait longer for this stream's answer (held in admission)."""
    whole = int(seconds)
    timeout = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    return ext_proc.ProcessingResponse(override_message_timeout=timeout).SerializeToString()
