"""A region that costs (almost) nothing: for measuring what the global tier adds on its own.

    python -m bench.standin_region --port 18443 --state-dir DIR [--model M]

What the global tier sees of a region, a Tier-1 gateway's TLS listener, without the
gateway behind it: on one TLS port (a certificate from igw_envoy.tls under DIR/tls; the
region's `caFile` is DIR/tls/ca.pem)
- any POST: bench.echo_server's one-token chat completion;
- `GET /igw/v1/load-summary` (contract.headers.LOAD_SUMMARY_PATH, picker.load_summary's
  document): one idle, ready pool serving the model, not saturated, a 50 ms predicted
  TTFT, its generation one higher at every answer (the router counts a summary whose
  generation stopped moving as stale), so the router places every request here;
- anything else: bench.echo_server's answers (404 for an unknown path).

HTTP/2 where the client asks for it by ALPN (the global tier's Envoy: `h2`, explicit
HTTP/2 to regions, igw_envoy.global_front), HTTP/1.1 otherwise (the router's poller,
aiohttp; wrk for the direct measurement). HTTP/1.1 is bench.echo_server's protocol
under TLS; HTTP/2 is framed here, just enough of it for what Envoy sends (RegionH2).

Prints `standin-region ready <port>` once listening; SIGTERM/SIGINT stop it. Bench and
test support: no part of the product.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from hpack import Decoder, Encoder, HPACKError

from bench.echo_server import COMPLETION, RESPONSES, EchoProtocol, _response, run
from bench.echo_server import serve_until_signalled as serve_echo
from bench.overhead import MODEL
from contract.headers import LOAD_SUMMARY_PATH
from igw_envoy.tls import DEFAULT_HOSTS, TlsFiles, ensure_self_signed, generated_files
from picker.h2_grpc import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
)

SUMMARY = LOAD_SUMMARY_PATH.encode()
JSON = b"application/json"
# SETTINGS parameters' identifiers, as they go on the wire
HEADER_TABLE_SIZE = (1).to_bytes(2, "big")
INITIAL_WINDOW_SIZE = SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big")
# HPACK's static table (RFC 7541 appendix A): `:method` GET and POST; the request
# pseudo-headers' names are entries 1-7 (:authority, :method, :path, :scheme)
STATIC_METHODS = {2: b"GET", 3: b"POST"}
LAST_PSEUDO = 7


class Summary:
    """The region's load summary: fixed but for its generation, which moves per answer."""

    def __init__(self, model: str) -> None:
        self.generation = 0
        self.pool = {
            "pool": "standin", "model": model, "adapters": [], "pods": 1, "readyPods": 1,
            "queueLength": 0, "engineWaiting": 0.0, "running": 0.0, "committedRequests": 0,
            "committedPrefillTokens": 0.0, "saturation": 0.0, "saturated": False,
            "predictedTtftS": 0.05, "typicalPromptTokens": 64, "prefillTokensPerS": 10000.0,
        }

    def body(self) -> bytes:
        self.generation += 1
        return orjson.dumps({
            "version": 1, "gateway": "standin-region", "generation": self.generation,
            "generatedAt": round(time.time(), 3), "intervalS": 0.25, "serving": True,
            "pools": [self.pool],
        })


class RegionH1(EchoProtocol):
    """bench.echo_server's HTTP/1.1, plus the load summary."""

    def __init__(self, summary: Summary) -> None:
        super().__init__()
        self.summary = summary

    def answer_get(self, path: bytes) -> bytes:
        if path == SUMMARY:
            return _response(b"200 OK", self.summary.body(), JSON)
        return super().answer_get(path)


def _header_block(status: bytes, ctype: bytes, length: int) -> bytes:
    """HPACK with no dynamic table entry (never-indexed literals), so nothing to track."""
    return Encoder().encode([
        (b":status", status, True), (b"content-type", ctype, True),
        (b"content-length", str(length).encode(), True), (b"x-sim-pod", b"standin", True),
    ], huffman=False)


def _h2_answer(head: bytes) -> tuple[bytes, bytes, bytes]:
    """(status, content type, body) of one of bench.echo_server's HTTP/1.1 answers."""
    head, _, body = head.partition(b"\r\n\r\n")
    ctype = head.lower().partition(b"content-type: ")[2].partition(b"\r\n")[0]
    return head.split(b" ", 2)[1], ctype, body


def _integer(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer at `block[i]` (RFC 7541 5.1): its value and the index after it."""
    mask = (1 << prefix_bits) - 1
    value, i = block[i] & mask, i + 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        byte, i = block[i], i + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _static_method(block: bytes) -> bytes | None:
    """GET or POST when the block's `:method` is the static table's entry, read by
    stepping over the pseudo-headers before it (static names 1-7) without decoding
    their values; None for anything else (then the block is decoded)."""
    i, end = 0, len(block)
    while i < end:
        byte = block[i]
        if byte & 0x80:  # an indexed field
            index, i = _integer(block, i, 7)
            if index in STATIC_METHODS:
                return STATIC_METHODS[index]
        elif byte & 0xE0 == 0x20:  # a dynamic table size update
            _, i = _integer(block, i, 5)
            continue
        else:  # a literal: a name index, then the value's length and octets
            index, i = _integer(block, i, 6 if byte & 0x40 else 4)
            if index in STATIC_METHODS:
                return None
            length, i = _integer(block, i, 7)
            i += length
        if not 0 < index <= LAST_PSEUDO:
            return None
    return None


COMPLETION_H2 = (_header_block(b"200", JSON, len(COMPLETION)), COMPLETION)


class RegionH2(asyncio.Protocol):
    """The same answers over HTTP/2, framed here: the `h2` library's state machine cost
    this process ~0.3 ms of CPU a request against ~0.02 for its HTTP/1.1, a difference the
    direct measurement (wrk: HTTP/1.1) would not take off. Request headers go through an
    HPACK decoder (`_request`: only until the client stops indexing); answers use no
    dynamic table. Flow control: the windows it grants are as large as allowed (the connection's
    topped up as DATA arrives); its own answers (a few hundred bytes) ignore the
    client's, which Envoy opens wide. PINGs (Envoy's keepalive) are answered."""

    def __init__(self, summary: Summary) -> None:
        self.summary = summary
        self.buf = b""
        self.preface = False
        self.decoder = Decoder()
        self.requests: dict[int, tuple[bytes, bytes]] = {}  # stream: (method, path)
        self.partial: tuple[int, int, bytes] | None = None  # stream, flags, block so far
        self.unacked = 0  # DATA bytes since the connection window was last topped up
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(
            frame(SETTINGS, 0, 0, HEADER_TABLE_SIZE + bytes(4)
                   + INITIAL_WINDOW_SIZE + MAX_WINDOW.to_bytes(4, "big"))
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        if not self.preface:
            if len(buf) < len(PREFACE):
                self.buf = buf
                return
            if not buf.startswith(PREFACE):
                self.transport.close()
                return
            buf = buf[len(PREFACE):]
            self.preface = True
        out: list[bytes] = []
        pos = 0
        try:
            while len(buf) - pos >= 9:
                end = pos + 9 + int.from_bytes(buf[pos:pos + 3], "big")
                if end > len(buf):
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                self._frame(kind, flags, stream, buf[pos + 9:end], out)
                pos = end
        except (HPACKError, ValueError, KeyError):
            self.transport.close()
            return
        self.buf = buf[pos:]
        if out:
            self.transport.write(b"".join(out))

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes, out: list[bytes]
               ) -> None:
        if kind == DATA:
            self.unacked += len(payload)
            if self.unacked > MAX_WINDOW // 2:
                out.append(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
                self.unacked = 0
            if flags & END_STREAM:
                self._answer(stream, out)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self.partial = (stream, flags, payload)
            if flags & END_HEADERS:
                self._headers_done(out)
        elif kind == CONTINUATION and self.partial is not None:
            first, first_flags, block = self.partial
            self.partial = (first, first_flags, block + payload)
            if flags & END_HEADERS:
                self._headers_done(out)
        elif kind == SETTINGS and not flags & ACK:
            out.append(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self.requests.pop(stream, None)
        elif kind == GOAWAY:
            self.transport.close()

    def _headers_done(self, out: list[bytes]) -> None:
        assert self.partial is not None
        stream, flags, block = self.partial
        self.partial = None
        request = self._request(block)
        if stream not in self.requests:  # else trailers: the request is known
            self.requests[stream] = request
        if flags & END_STREAM:
            self._answer(stream, out)

    def _request(self, block: bytes) -> tuple[bytes, bytes]:
        """(method, path). Once the client's encoder has applied the zero-sized table
        asked for in SETTINGS, no block leaves state behind, and a POST is known from the
        static table's `:method: POST` without decoding the block (Huffman-coded values
        make decoding the costliest part of a request here, ~40 µs)."""
        if self.decoder.header_table.maxsize == 0 and _static_method(block) == b"POST":
            return b"POST", b""
        headers = dict(self.decoder.decode(block, raw=True))
        return headers.get(b":method", b""), headers.get(b":path", b"")

    def _answer(self, stream: int, out: list[bytes]) -> None:
        method, path = self.requests.pop(stream, (b"", b""))
        if method == b"POST":
            block, body = COMPLETION_H2
        else:
            if path.partition(b"?")[0] == SUMMARY:
                status, ctype, body = b"200", JSON, self.summary.body()
            else:  # what bench.echo_server answers to a GET
                status, ctype, body = _h2_answer(RESPONSES.get(path, RESPONSES[b"404"]))
            block = _header_block(status, ctype, len(body))
        out.append(frame(HEADERS, END_HEADERS, stream, block)
                   + frame(DATA, END_STREAM, stream, body))


class RegionProtocol(asyncio.Protocol):
    """Hands the connection to HTTP/2 or HTTP/1.1 by the ALPN the TLS handshake chose."""

    def __init__(self, summary: Summary) -> None:
        self.summary = summary

    def connection_made(self, transport: Any) -> None:
        tls = transport.get_extra_info("ssl_object")
        alpn = tls.selected_alpn_protocol() if tls is not None else None
        protocol = RegionH2(self.summary) if alpn == "h2" else RegionH1(self.summary)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


def ca_file(state_dir: Path) -> Path:
    """The CA of the stand-in serving from `state_dir`: the region's `caFile`."""
    ca = generated_files(state_dir).ca_cert
    assert ca is not None
    return ca


def server_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


async def serve(port: int, state_dir: Path, model: str, host: str = "127.0.0.1") -> None:
    summary = Summary(model)
    context = server_context(ensure_self_signed(state_dir, DEFAULT_HOSTS))
    await serve_echo(lambda: RegionProtocol(summary), port, host, ssl=context,
                     label="standin-region")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.standin_region")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state-dir", type=Path, required=True,
                   help="where the certificate goes (STATE_DIR/tls/ca.pem is its CA)")
    p.add_argument("--model", default=MODEL, help="the model the summary says it serves")
    args = p.parse_args(argv)
    run(serve(args.port, args.state_dir, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
