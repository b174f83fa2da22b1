"""A purpose-built HTTP/2 gRPC server for the ext_proc port.

Why not a general gRPC server: behind the same Envoy, with the gateway's
ext_proc filter on its one-message route, a stub that does nothing costs in
CPU per HTTP request, at 1 / 32 connections: 0.45 / 0.28 ms on grpc.aio (C-core
completion queues, a poller thread, a Python future and several loop
iterations per message), 0.41 / 0.29 ms on grpclib (pure Python on the `h2`
package), 0.08 / 0.02 ms on this server: 5-13x less, with 1.6-2.3x the
requests/s and under half the added p50. The picker's CPU budget per request
is 0.4 ms, so either general server alone would spend it all. Reproduce with
`igw bench --ext-proc-servers` (bench/ext_proc_servers.py; figures, taken on a
loaded 2-core machine, in bench/results/ext_proc_servers.md).

What it serves is narrow, and that is what makes it cheap: one long-lived
h2c connection per Envoy worker, streams of length-prefixed protobuf messages,
two methods (ext_proc `Process`, bidirectional; `grpc.health.v1.Health/Check`,
unary), no compression, no TLS (loopback or pod network). The full protocol
surface a client may use is still handled correctly: SETTINGS, PING,
WINDOW_UPDATE and flow control in both directions, CONTINUATION, padding and
priority fields, RST_STREAM, GOAWAY, frames on closed streams, and any other
method answered UNIMPLEMENTED. A client that breaks the protocol gets a
GOAWAY with the error code and the connection is closed; nothing it sends is
buffered without bound.

Request headers are HPACK-decoded with the `hpack` package (for `:path`), but
a header block seen before, while the decoder's dynamic table has not
changed, is answered from a small memo: Envoy sends the same bytes for every
stream, so the steady state costs one dict lookup.

Streams are handed to a `StreamHandler` (one per stream, created by the
factory for the path): it receives whole messages and the end of the
client's side, and answers through `Stream.send` / `Stream.finish`.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Protocol

from grpc_health.v1 import health_pb2
from hpack import Decoder
from hpack.exceptions import HPACKError

log = logging.getLogger("picker.h2_grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0x6, 0x7, 0x9
ENHANCE_YOUR_CALM = 0xB

SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
# Our receive limits: a frame can carry a whole typical request body; a
# message (and so a stream's buffer) is bounded by what the picker accepts.
RECV_FRAME_SIZE = 1 << 20
MAX_CONCURRENT_STREAMS = 100_000
MAX_HEADER_BLOCK = 64 << 10
# Refill the connection receive window once this much of it was consumed.
WINDOW_REFILL = 1 << 30
HEADER_MEMO_SIZE = 64

GRPC_OK, GRPC_NOT_FOUND, GRPC_RESOURCE_EXHAUSTED = 0, 5, 8
GRPC_UNIMPLEMENTED, GRPC_INTERNAL, GRPC_UNAVAILABLE = 12, 13, 14

_FRAME = struct.Struct(">IBI")  # (length << 8 | type, flags, stream id)
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")

# HPACK without the dynamic table: ":status: 200" is static entry 8;
# content-type (static name 31) and grpc-* are literals without indexing.
_RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def grpc_message(payload: bytes) -> bytes:
    """gRPC length-prefixed message, uncompressed."""
    return b"\x00" + _U32.pack(len(payload)) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (lengths < 127)."""
    return b"\x00" + bytes((len(name),)) + name + _length(value) + value


def _length(value: bytes) -> bytes:
    n = len(value)
    if n < 127:
        return bytes((n,))
    out = bytearray((127,))
    n -= 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def trailers(status: int, message: str = "") -> bytes:
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message))
    return block


def _percent_encode(text: str) -> bytes:
    """grpc-message is percent-encoded outside printable ASCII (and '%')."""
    out = bytearray()
    for byte in text.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


_OK_TRAILERS = trailers(GRPC_OK)


class ProtocolError(Exception):
    """The client broke HTTP/2: the connection ends with a GOAWAY carrying `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class StreamHandler(Protocol):
    """One gRPC call. Methods run on the event loop and must not block."""

    def on_message(self, message: bytes) -> None:
        """A whole request message (without the gRPC length prefix)."""
        ...

    def on_end(self, reset: bool) -> None:
        """The client finished its side (`reset`: it cancelled the call)."""
        ...


HandlerFactory = Callable[["Stream"], StreamHandler]


class Stream:
    """The server's side of one call: send messages, then finish with a status."""

    __slots__ = (
        "_buffer",
        "_conn",
        "_headers_sent",
        "done",
        "handler",
        "id",
        "remote_closed",
        "reset",
        "send_window",
        "trailers_sent",
    )

    def __init__(self, conn: H2Connection, stream_id: int, send_window: int) -> None:
        self._conn = conn
        self.id = stream_id
        self.send_window = send_window
        self._buffer = bytearray()
        self._headers_sent = False
        self.remote_closed = False
        self.reset = False  # cancelled by the client or the connection: nothing more is sent
        self.done = False  # finish() called
        self.trailers_sent = False  # ... and its trailers written (flow control may delay them)
        self.handler: StreamHandler | None = None

    def send(self, message: bytes) -> None:
        """Send one response message (serialized protobuf)."""
        if self.done:
            return
        head = b""
        if not self._headers_sent:
            self._headers_sent = True
            head = frame(HEADERS, END_HEADERS, self.id, _RESPONSE_HEADERS)
        self._conn.send_data(self, head, grpc_message(message))

    def finish(self, status: int = GRPC_OK, message: str = "") -> None:
        """End the call with a gRPC status (trailers-only when nothing was sent)."""
        if self.done:
            return
        self.done = True
        block = _OK_TRAILERS if status == GRPC_OK and not message else trailers(status, message)
        if not self._headers_sent:
            block = _RESPONSE_HEADERS + block
        self._conn.send_trailers(self, block)


class H2Connection(asyncio.Protocol):
    """One client connection: frame parsing, flow control, streams."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self._buf = b""
        self._preface = False
        self._decoder = Decoder()
        self._memo: dict[bytes, str] = {}
        self._table_mark: tuple[int, object, int] = (0, None, 0)
        self._header_block: bytearray | None = None
        self._header_stream = 0
        self._header_end_stream = False
        self._last_stream = 0
        self._peer_window = DEFAULT_WINDOW  # initial stream send window
        self._peer_frame = DEFAULT_FRAME
        self._send_window = DEFAULT_WINDOW  # connection send window
        self._pending: list[tuple[Stream, bytes, bytes, bool]] = []
        self._received = 0
        self._out: list[bytes] | None = None
        self.going_away = False  # a GOAWAY was sent or received: no new streams

    # -- transport callbacks -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        settings = (
            _SETTING.pack(SETTINGS_MAX_CONCURRENT_STREAMS, MAX_CONCURRENT_STREAMS)
            + _SETTING.pack(SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
            + _SETTING.pack(SETTINGS_MAX_FRAME_SIZE, RECV_FRAME_SIZE)
        )
        self.transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            self._end_stream(stream, reset=True)

    def data_received(self, data: bytes) -> None:
        self._out = []
        try:
            self._parse(self._buf + data if self._buf else data)
        except ProtocolError as exc:
            self._fail(exc.code, str(exc))
        except Exception:
            log.exception("ext_proc connection failed")
            self._fail(INTERNAL_ERROR, "internal error")
        finally:
            out, self._out = self._out, None
            if out and self.transport is not None:
                self.transport.write(b"".join(out))

    # -- parsing -----------------------------------------------------------------

    def _parse(self, buf: bytes) -> None:
        pos = 0
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                self._buf = buf
                return
            if not buf.startswith(PREFACE):
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self._preface = True
            pos = len(PREFACE)
        end = len(buf)
        while end - pos >= 9:
            head, flags, stream_id = _FRAME.unpack_from(buf, pos)
            length = head >> 8
            if length > RECV_FRAME_SIZE:
                raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            if end - pos - 9 < length:
                break
            start = pos + 9
            pos = start + length
            self._frame(head & 0xFF, flags, stream_id & MAX_WINDOW, buf[start:pos])
        self._buf = buf[pos:] if pos < end else b""

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise ProtocolError(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._emit(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._end_stream(stream, reset=True)
        elif kind == GOAWAY:
            self.going_away = True  # the client leaves
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 requires.

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        self._received += len(payload)
        if self._received >= WINDOW_REFILL:
            self._emit(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._received)))
            self._received = 0
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return  # a stream we already finished or reset: its data is moot
        buffer = stream._buffer
        if payload:
            buffer += payload
            self._messages(stream)
        if flags & END_STREAM:
            stream.remote_closed = True
            if buffer:
                stream.finish(GRPC_INTERNAL, "incomplete message")
            self._end_stream(stream, reset=False)

    def _messages(self, stream: Stream) -> None:
        """Hand every complete length-prefixed message to the stream's handler."""
        buffer = stream._buffer
        while len(buffer) >= 5:
            size = _U32.unpack_from(buffer, 1)[0]
            if buffer[0]:
                self._abort(stream, GRPC_UNIMPLEMENTED, "compressed messages are not supported")
                return
            if size > self.server.max_message:
                self._abort(stream, GRPC_RESOURCE_EXHAUSTED, f"message of {size} bytes")
                return
            if len(buffer) < 5 + size:
                return
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            if stream.handler is not None and not stream.done:
                try:
                    stream.handler.on_message(message)
                except Exception:
                    log.exception("ext_proc stream handler failed")
                    stream.handler = None
                    self._abort(stream, GRPC_INTERNAL, "internal error")
                    return

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if len(payload) > MAX_HEADER_BLOCK:
            raise ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        self._header_stream = stream_id
        self._header_end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._on_header_block(payload)
        else:
            self._header_block = bytearray(payload)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._header_block
        if block is None or stream_id != self._header_stream:
            raise ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._header_block = None
            self._on_header_block(bytes(block))

    def _on_header_block(self, block: bytes) -> None:
        path = self._path(block)
        stream_id = self._header_stream
        existing = self.streams.get(stream_id)
        if existing is not None:
            # Trailers from the client (gRPC clients send none): end of its side.
            if self._header_end_stream:
                existing.remote_closed = True
                self._end_stream(existing, reset=False)
            return
        if stream_id <= self._last_stream:
            return  # a stream we closed long ago (e.g. reset): ignore its late headers
        self._last_stream = stream_id
        stream = Stream(self, stream_id, self._peer_window)
        stream.remote_closed = self._header_end_stream
        if self.going_away or self.server.draining:
            self._abort(stream, GRPC_UNAVAILABLE, "server is shutting down", REFUSED_STREAM)
            return
        if len(self.streams) >= MAX_CONCURRENT_STREAMS:  # what our SETTINGS announced
            self._abort(
                stream, GRPC_RESOURCE_EXHAUSTED, "too many concurrent streams", REFUSED_STREAM
            )
            return
        self.streams[stream_id] = stream
        factory = self.server.methods.get(path)
        if factory is None:
            self._abort(stream, GRPC_UNIMPLEMENTED, f"unknown method {path[:200]}")
            return
        stream.handler = factory(stream)
        if stream.remote_closed:
            self._end_stream(stream, reset=False)

    def _path(self, block: bytes) -> str:
        """`:path` of a header block; memoized while the dynamic table is unchanged."""
        mark = self._table_mark
        path = self._memo.get(block)
        if path is not None and self._mark() == mark:
            return path
        try:
            headers = self._decoder.decode(block, raw=True)
        except HPACKError as exc:
            raise ProtocolError(COMPRESSION_ERROR, f"HPACK: {exc}") from None
        path = ""
        for name, value in headers:
            if name == b":path":
                path = value.decode("latin-1")
                break
        new_mark = self._mark()
        if new_mark != mark:
            self._memo.clear()
            self._table_mark = new_mark
        elif len(self._memo) < HEADER_MEMO_SIZE:
            self._memo[block] = path
        return path

    def _mark(self) -> tuple[int, object, int]:
        """Identity of the decoder's dynamic table: entries are added at the left."""
        table = self._decoder.header_table
        entries = table.dynamic_entries
        return (len(entries), entries[0] if entries else None, table.maxsize)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                return
            stream.send_window += increment
        self._flush_pending()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "bad SETTINGS")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_window
                self._peer_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_frame = value
        self._emit(frame(SETTINGS, ACK, 0))
        self._flush_pending()

    # -- sending -----------------------------------------------------------------

    def send_data(self, stream: Stream, head: bytes, data: bytes) -> None:
        if not self._pending:
            rest = self._write_data(stream, head, data)
            if rest is None:
                return
            head, data = rest
        self._pending.append((stream, head, data, False))
        self._flush_pending()

    def send_trailers(self, stream: Stream, block: bytes) -> None:
        if self._pending:
            self._pending.append((stream, b"", block, True))
            self._flush_pending()
        else:
            self._write_trailers(stream, block)

    def _write_trailers(self, stream: Stream, block: bytes) -> None:
        self._emit(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block))
        stream.trailers_sent = True
        if stream.remote_closed:
            self.streams.pop(stream.id, None)

    def _write_data(self, stream: Stream, head: bytes, data: bytes) -> tuple[bytes, bytes] | None:
        """Write what the windows allow; the unsent (head, data), or None when all went."""
        room = min(self._send_window, stream.send_window)
        if room <= 0:
            return head, data
        sent = data[:room]
        self._send_window -= len(sent)
        stream.send_window -= len(sent)
        if len(sent) <= self._peer_frame:
            self._emit(head + frame(DATA, 0, stream.id, sent))
        else:
            step = self._peer_frame
            chunks = (
                frame(DATA, 0, stream.id, sent[i : i + step]) for i in range(0, len(sent), step)
            )
            self._emit(head + b"".join(chunks))
        return None if len(sent) == len(data) else (b"", data[room:])

    def _flush_pending(self) -> None:
        """Write what flow control allows, in order per stream; a stream out of window
        waits for its WINDOW_UPDATE without holding up the others; a reset one is dropped."""
        kept: list[tuple[Stream, bytes, bytes, bool]] = []
        blocked: set[int] = set()
        for entry in self._pending:
            stream, head, data, is_trailers = entry
            if stream.reset:
                continue
            if stream.id in blocked:
                kept.append(entry)
            elif is_trailers:
                self._write_trailers(stream, data)
            elif (rest := self._write_data(stream, head, data)) is not None:
                kept.append((stream, *rest, False))
                blocked.add(stream.id)
        self._pending = kept

    def _emit(self, chunk: bytes) -> None:
        if self._out is not None:
            self._out.append(chunk)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(chunk)

    def _abort(self, stream: Stream, status: int, message: str, code: int = NO_ERROR) -> None:
        """End a call with an error status, and tell the client to stop sending on it."""
        stream.finish(status, message)
        self.streams.pop(stream.id, None)
        if not stream.remote_closed:
            stream.remote_closed = True
            self._emit(frame(RST_STREAM, 0, stream.id, _U32.pack(code)))

    def _end_stream(self, stream: Stream, reset: bool) -> None:
        handler = stream.handler
        stream.handler = None
        if handler is not None:
            try:
                handler.on_end(reset)
            except Exception:
                log.exception("stream end handler failed")
        if reset:
            stream.done = stream.reset = True
        elif not stream.done and handler is None:
            stream.finish()
        if reset or stream.trailers_sent:
            self.streams.pop(stream.id, None)

    def _fail(self, code: int, reason: str) -> None:
        log.warning("ext_proc connection closed: %s", reason)
        self.goaway(code, reason)
        if self.transport is not None:
            if self._out:
                self.transport.write(b"".join(self._out))
                self._out.clear()
            self.transport.close()  # after the buffered GOAWAY is written

    def goaway(self, code: int = NO_ERROR, reason: str = "") -> None:
        """Refuse new streams; streams already open run to completion."""
        self.going_away = True
        payload = _U32.pack(self._last_stream) + _U32.pack(code) + reason.encode()[:200]
        self._emit(frame(GOAWAY, 0, 0, payload))


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise ProtocolError(PROTOCOL_ERROR, "padded frame without pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]


class H2GrpcServer:
    """Listens, accepts connections, and routes each new stream by its `:path`."""

    def __init__(self, methods: dict[str, HandlerFactory], max_message: int) -> None:
        self.methods = methods
        self.max_message = max_message
        self.connections: set[H2Connection] = set()
        self.draining = False
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: H2Connection(self), host, port, reuse_address=True
        )

    def open_streams(self) -> int:
        """Streams a drain waits for: every call but those whose handler says it never
        ends on its own (`holds_drain = False`: Envoy's access log stream, which stays
        open as long as Envoy runs)."""
        return sum(
            1 for c in self.connections for st in c.streams.values()
            if getattr(st.handler, "holds_drain", True)
        )

    async def stop(self, grace: float) -> None:
        """GOAWAY every connection, let open streams finish for up to `grace` s, close."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.open_streams() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()


HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"


class HealthCheck:
    """grpc.health.v1 `Check` (unary): `status_of(service)` gives the serving status,
    None for a service this server does not know (NOT_FOUND, as the standard asks)."""

    def __init__(self, stream: Stream, status_of: Callable[[str], int | None]) -> None:
        self.stream = stream
        self.status_of = status_of

    def on_message(self, message: bytes) -> None:
        service = health_pb2.HealthCheckRequest.FromString(message).service
        status = self.status_of(service)
        if status is None:
            self.stream.finish(GRPC_NOT_FOUND, f"unknown service {service[:200]}")
            return
        self.stream.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.stream.finish()

    def on_end(self, reset: bool) -> None:
        if not reset:
            self.stream.finish(GRPC_INTERNAL, "health check request missing")
