"""The ext_proc port's HTTP/2 gRPC server, checked against a real gRPC client (grpcio's
C-core: an independent implementation of HTTP/2, HPACK and gRPC framing) and raw sockets."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hpack import Encoder

from igw.ports import free_port
from picker import h2_grpc
from picker.h2_grpc import (
    GOAWAY,
    HEALTH_CHECK_PATH,
    PREFACE,
    H2GrpcServer,
    HealthCheck,
    Stream,
    frame,
)

ECHO = "/test.Echo/Chat"


class Echo:
    """Answers every message with its reverse; `fail` ends the call with an error."""

    ended: ClassVar[list[tuple[int, bool]]] = []

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def on_message(self, message: bytes) -> None:
        if message == b"fail":
            self.stream.finish(3, "bad input: ünïcode")
            return
        if message == b"crash":
            raise RuntimeError("handler bug")
        self.stream.send(message[::-1])

    def on_end(self, reset: bool) -> None:
        Echo.ended.append((self.stream.id, reset))
        if not reset:
            self.stream.finish()


class Forever(Echo):
    """A call that never ends on its own (like Envoy's access log stream): a drain does not
    wait for it."""

    holds_drain = False


FOREVER = "/test.Echo/Forever"


class Server:
    """An H2GrpcServer on its own event loop thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.server = H2GrpcServer(
            {
                ECHO: Echo,
                FOREVER: Forever,
                HEALTH_CHECK_PATH: lambda s: HealthCheck(
                    s, lambda name: health_pb2.HealthCheckResponse.SERVING if name == "" else None
                ),
            },
            max_message=8 << 20,
        )
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start("127.0.0.1", self.port))

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture()
def server() -> Iterator[Server]:
    srv = Server()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture()
def channel(server: Server) -> Iterator[grpc.Channel]:
    options = [("grpc.max_receive_message_length", 16 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as ch:
        yield ch


def _chat(channel: grpc.Channel):
    return channel.stream_stream(ECHO, request_serializer=None, response_deserializer=None)


def test_bidirectional_stream_round_trips_every_message(channel: grpc.Channel) -> None:
    replies = list(_chat(channel)(iter([b"abc", b"", b"hello"]), timeout=5))
    assert replies == [b"cba", b"", b"olleh"]


def test_many_calls_on_one_connection(channel: grpc.Channel) -> None:
    chat = _chat(channel)
    for i in range(200):
        assert list(chat(iter([str(i).encode()]), timeout=5)) == [str(i).encode()[::-1]]


def test_messages_larger_than_frames_and_windows_both_ways(channel: grpc.Channel) -> None:
    # 5 MiB exceeds the client's initial windows (64 KiB) and any frame size: the
    # server must split its answer and wait for the client's WINDOW_UPDATEs.
    payload = bytes(range(256)) * (5 * 4096)
    replies = list(_chat(channel)(iter([payload, b"x"]), timeout=20))
    assert replies[0] == payload[::-1]
    assert replies[1] == b"x"


def test_error_status_and_percent_encoded_message(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(_chat(channel)(iter([b"fail"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "bad input: ünïcode"


def test_handler_exception_is_internal_not_a_dead_connection(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(_chat(channel)(iter([b"crash"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert list(_chat(channel)(iter([b"ok"]), timeout=5)) == [b"ko"]


def test_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    call = channel.unary_unary(
        "/nope.Service/Method", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as info:
        call(b"x", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "/nope.Service/Method" in info.value.details()


def test_health_check(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="other"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancelled_call_reaches_the_handler_as_reset(channel: grpc.Channel) -> None:
    Echo.ended.clear()
    release = threading.Event()

    def requests():
        yield b"first"
        release.wait(5)

    call = _chat(channel)(requests(), timeout=10)
    assert next(call) == b"tsrif"
    call.cancel()
    release.set()
    deadline = time.monotonic() + 5
    while not any(reset for _, reset in Echo.ended) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(reset for _, reset in Echo.ended)


def test_drain_refuses_new_calls_and_lets_open_ones_finish(server: Server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        release = threading.Event()

        def requests():
            yield b"open"
            release.wait(5)
            yield b"last"

        call = _chat(ch)(requests(), timeout=10)
        assert next(call) == b"nepo"
        stopping = asyncio.run_coroutine_threadsafe(server.server.stop(grace=5.0), server.loop)
        time.sleep(0.2)
        release.set()
        assert list(call) == [b"tsal"]
        stopping.result(10)


def test_drain_does_not_wait_for_a_call_that_never_ends(server: Server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        release = threading.Event()

        def requests():
            yield b"open"
            release.wait(10)

        forever = ch.stream_stream(FOREVER)(requests(), timeout=15)
        assert next(forever) == b"nepo"
        started = time.monotonic()
        server.call(server.server.stop(grace=5.0))
        assert time.monotonic() - started < 2.0  # not the 5 s grace
        release.set()


def _raw_connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_frames(sock: socket.socket) -> list[tuple[int, int, int, bytes]]:
    data = b""
    sock.settimeout(2)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    frames, pos = [], 0
    while len(data) - pos >= 9:
        head, flags, sid = struct.unpack_from(">IBI", data, pos)
        length = head >> 8
        frames.append((head & 0xFF, flags, sid, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    return frames


def test_garbage_preface_gets_goaway_and_close(server: Server) -> None:
    with _raw_connect(server.port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        frames = _read_frames(sock)
    goaways = [f for f in frames if f[0] == GOAWAY]
    assert goaways and struct.unpack(">I", goaways[0][3][4:8])[0] == 1  # PROTOCOL_ERROR


def test_oversized_frame_is_a_frame_size_error(server: Server) -> None:
    with _raw_connect(server.port) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + struct.pack(">IBI", (2 << 20) << 8, 0, 1))
        frames = _read_frames(sock)
    goaways = [f for f in frames if f[0] == GOAWAY]
    assert goaways and struct.unpack(">I", goaways[0][3][4:8])[0] == 6  # FRAME_SIZE_ERROR


def test_ping_is_answered(server: Server) -> None:
    with _raw_connect(server.port) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + frame(6, 0, 0, b"12345678"))
        frames = _read_frames(sock)
    assert (6, 1, 0, b"12345678") in frames


def _request_headers(path: str) -> bytes:
    return Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "picker"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )


def test_streams_beyond_the_announced_limit_are_refused(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_grpc, "MAX_CONCURRENT_STREAMS", 1)
    with _raw_connect(server.port) as sock:
        sock.sendall(
            PREFACE
            + frame(4, 0, 0)
            + frame(1, 4, 1, _request_headers(ECHO))
            + frame(1, 4, 3, _request_headers(ECHO))
        )
        frames = _read_frames(sock)
    resets = [
        (sid, struct.unpack(">I", payload)[0]) for kind, _, sid, payload in frames if kind == 3
    ]
    assert resets == [(3, 7)]  # REFUSED_STREAM on the second stream only


def test_a_stream_out_of_window_or_reset_does_not_hold_up_the_others(server: Server) -> None:
    # The client opens every stream with a zero send window for the server: stream 1's
    # answer waits; the client resets stream 1 and opens a window on stream 3 only.
    window_zero = frame(4, 0, 0, struct.pack(">HI", 4, 0))
    with _raw_connect(server.port) as sock:
        sock.sendall(
            PREFACE
            + window_zero
            + frame(1, 4, 1, _request_headers(ECHO))
            + frame(0, 0, 1, b"\x00\x00\x00\x00\x02ab")
            + frame(1, 4, 3, _request_headers(ECHO))
            + frame(0, 0, 3, b"\x00\x00\x00\x00\x02cd")
            + frame(3, 0, 1, struct.pack(">I", 8))  # RST_STREAM CANCEL
            + frame(8, 0, 3, struct.pack(">I", 100))  # WINDOW_UPDATE on stream 3
        )
        frames = _read_frames(sock)
    data = [(sid, payload) for kind, _, sid, payload in frames if kind == 0]
    assert data == [(3, b"\x00\x00\x00\x00\x02dc")]
