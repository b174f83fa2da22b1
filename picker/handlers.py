"""The ext_proc stream state machine: [headers →] body → (wait for the end).

One gRPC stream per HTTP request, served by picker.h2_grpc. The common request
(POST to an inference path with a content-length within the limit,
igw_envoy.routes' `one_message_route`) costs one message: Envoy skips the headers and
sends the buffered body with the header values the picker reads as attributes. Any
other request starts with a headers message, which the picker may answer on
its own (model list, 404, 405, 400, 413) before the body is read. The body is
answered with the routing decision. The stream stays open until Envoy
finishes the HTTP request, so the stream's end is the request's end: that is
where in-flight accounting is closed, at no extra message cost. Everything a
client can get wrong becomes an ApiError in the director and is turned into
an ImmediateResponse here, in one place. The bytes themselves (reading
Envoy's messages, encoding the answers) are picker.ext_proc_wire.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Protocol

from bbr.request import API_PATHS
from contract.errors import (
    ApiError,
    BodyTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
)
from picker.director import RequestInfo
from picker.ext_proc_wire import (
    CONTINUE_HEADERS,
    CONTINUE_RESPONSE_HEADERS,
    RequestHeaders,
    error_response,
    extend_timeout,
    immediate,
    parse_request,
    read_attributes,
    read_headers,
    route_response,
    status_of,
)
from picker.h2_grpc import Stream
from picker.tenants.identity import TenantDirectory

_MODELS_PATHS = frozenset({"/v1/models", "/models"})


class Routed(Protocol):
    """A routing decision as the stream sees it: held for admission, or routed with
    these `envoy.lb` values; `status` is the upstream's, recorded for the books."""

    admission_wait: float | None
    headers: list[tuple[str, str]]
    limit_headers: list[tuple[str, str]] | None
    status: int


class Router(Protocol):
    """What the stream state machine asks of a director: picker.director.Director (pods
    of a pool) or globalrouter.director.GlobalDirector (regions); the transport is one."""

    tenants: TenantDirectory
    config: Any  # its `bbr.max_request_body_bytes` bounds the body

    def models_body(self) -> bytes: ...

    def route_now(self, body: bytes, info: RequestInfo) -> Routed: ...

    async def admit(self, decision: Any) -> None: ...

    def abandon(self, decision: Any) -> None: ...

    def complete(self, decision: Any) -> None: ...


class Phase(enum.Enum):
    """Where one call is, and so which message it acts on; any other is ignored.

    request_headers are read once, the first time they come, whatever the
    phase (Envoy sends them first or not at all). Once the call is ANSWERED or
    ENDED, picker.h2_grpc delivers no more messages.
    """

    OPEN = "open"  # no body yet: request_body routes (with the attributes if no headers came)
    HELD = "held"  # the body waits in admission: the admission task answers, not a message
    ROUTED = "routed"  # the route was sent: response_headers records the status
    ANSWERED = "answered"  # an error or immediate answer instead of a route: the call is finished
    ENDED = "ended"  # Envoy closed the call: the request is over and its accounting closed


# Checked as module globals: `Phase.X` goes through the enum's metaclass, several
# times the cost of a global lookup, on every message.
_OPEN = Phase.OPEN
_HELD = Phase.HELD
_ROUTED = Phase.ROUTED
_ANSWERED = Phase.ANSWERED
_ENDED = Phase.ENDED


class ExtProcHandler:
    """Serves envoy.service.ext_proc.v3.ExternalProcessor/Process: `stream` makes the
    per-call state machine for picker.h2_grpc; what the headers alone decide is here."""

    def __init__(self, director: Router) -> None:
        self.director = director

    def stream(self, stream: Stream) -> ExtProcStream:
        return ExtProcStream(self, stream)

    def on_headers(self, info: RequestHeaders, end_of_stream: bool) -> bytes:
        """Everything the headers alone decide, before Envoy buffers a body for nothing:
        the model list, unknown paths (404), other methods than POST (405), a missing
        body (400), a declared length over the limit (413, without reading the body).
        With tenants, a request without a valid key is refused (401) before any of it."""
        tenants = self.director.tenants
        if tenants.enabled:
            tenants.identify(info.authorization, info.tenant_claim)
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
    """One HTTP request's ext_proc call, its progress in `Phase`:

        OPEN ─body─▶ ROUTED | HELD ─admitted─▶ ROUTED
        OPEN ─headers answered, or an error─▶ ANSWERED;  HELD ─refused─▶ ANSWERED
        any ─Envoy ends the call─▶ ENDED

    Driven by message callbacks from picker.h2_grpc, so the common request is
    answered synchronously inside the connection's read callback (no task, no
    future); only a request held by admission control gets a task. The call's
    end (Envoy closes it when the HTTP request is over) closes the accounting.
    """

    __slots__ = ("_admission", "_decision", "_handler", "_info", "_phase", "_stream")

    def __init__(self, handler: ExtProcHandler, stream: Stream) -> None:
        self._handler = handler
        self._stream = stream
        self._phase = _OPEN
        self._info: RequestHeaders | None = None
        self._decision: Routed | None = None
        self._admission: asyncio.Task[None] | None = None

    def on_message(self, message: bytes) -> None:
        msg = parse_request(message)
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_body":
                if self._phase is _OPEN:
                    # No headers message: the one-message route sent them as attributes.
                    info = self._info if self._info is not None else read_attributes(msg)
                    self._on_body(msg.request_body.body, info)
            elif kind == "request_headers":
                if self._info is None:
                    self._info = read_headers(msg.request_headers.headers)
                    end = msg.request_headers.end_of_stream
                    answer = self._handler.on_headers(self._info, end)
                    if answer is CONTINUE_HEADERS:
                        self._stream.send(answer)
                    else:
                        self._answer(answer)
            elif kind == "response_headers" and self._phase is _ROUTED:
                self._decision.status = status_of(msg.response_headers.headers)
                self._stream.send(CONTINUE_RESPONSE_HEADERS)
        except ApiError as exc:
            self._answer(error_response(exc))

    def _answer(self, answer: bytes) -> None:
        """Answer the client instead of routing, and finish the call.

        A held or routed request keeps its phase (headers arriving after a
        one-message body): its admission or accounting still ends with the call.
        """
        self._stream.send(answer)
        self._stream.finish()
        if self._phase is _OPEN:
            self._phase = _ANSWERED

    def _on_body(self, body: bytes, info: RequestHeaders) -> None:
        request = RequestInfo(
            path=info.path,
            content_type=info.content_type,
            content_encoding=info.content_encoding,
            priority=info.priority,
            criticality=info.criticality,
            request_id=info.request_id,
            authorization=info.authorization,
            tenant_claim=info.tenant_claim,
            regions=info.regions,
            session=info.session,
        )
        decision = self._handler.director.route_now(body, request)
        if decision.admission_wait is None:
            self._decision = decision
            self._phase = _ROUTED
            self._stream.send(route_response(decision.headers, decision.limit_headers))
            return
        self._stream.send(extend_timeout(decision.admission_wait + 1.0))
        self._decision = decision
        self._admission = asyncio.get_running_loop().create_task(self._admit(decision))
        self._phase = _HELD

    async def _admit(self, decision: Routed) -> None:
        """Wait in the pool's admission queue, then answer (or fail) the held request."""
        try:
            await self._handler.director.admit(decision)
        except ApiError as exc:
            self._stream.send(error_response(exc))
            self._stream.finish()
            self._phase = _ANSWERED
            return
        self._decision = decision
        self._phase = _ROUTED
        self._stream.send(route_response(decision.headers, decision.limit_headers))

    def on_end(self, reset: bool) -> None:
        """Envoy closed the call: the HTTP request is over; release its accounting."""
        if self._phase is _HELD:
            self._admission.cancel()
            # a task cancelled before its first step never runs its own cleanup
            self._handler.director.abandon(self._decision)
        elif self._phase is _ROUTED:
            self._handler.director.complete(self._decision)
        self._phase = _ENDED
        self._stream.finish()
