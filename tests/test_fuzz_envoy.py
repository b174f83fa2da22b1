"""Hostile input through the real front door: TLS → Envoy → picker (`igw serve`), simulated pods.

tests/test_bbr_properties.py fuzzes the body parser in-process; this suite sends
the same kind of input over HTTPS so that Envoy's own limits, the ext_proc
hand-off and the error mapping are all on the path. For every input: a 4xx
(or a 200 when the input is in fact acceptable), an OpenAI-style JSON error
body, never a 5xx, never a hang (every request has a timeout), and the picker
and Envoy processes are the same ones at the end (nothing crashed).

Also here: client routing headers are never honoured, the picker's and Envoy's
admin ports listen on loopback only, the TLS policy and certificate reload
through `igw serve`, and JWT authentication keeping unauthenticated requests
away from the picker.
"""

from __future__ import annotations

import gzip
import ipaddress
import json
import socket
import ssl
import time
import warnings
from pathlib import Path

import httpx
import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from igw_envoy.tls import ensure_self_signed, generated_files, issue_server_cert, load_ca
from tests.jwt_keys import b64url, es256_token, jwks
from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import (
    children,
    client_ssl,
    envoy_stat,
    listening_sockets,
    wait_for,
)

M, N = "model-m", "model-n"
BODY_LIMIT = 1024 * 1024
PODS = [
    {"name": "m0", "gpu": "h100", "model": M},
    {"name": "n0", "gpu": "h100", "model": N},
]
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    with sim_fleet(tmp, PODS, time_scale=20.0) as fleet:
        config = gateway_config(
            [
                {"name": "m", "modelName": M, "endpoints": [fleet.address("m0")]},
                {"name": "n", "modelName": N, "endpoints": [fleet.address("n0")]},
            ],
            bbr={"enabled": True, "maxRequestBodyBytes": BODY_LIMIT},
        )
        with gateway(tmp, config) as gw:
            pids = children(gw.proc.pid)
            yield fleet, gw
            assert children(gw.proc.pid) == pids, "the picker or Envoy restarted (crashed)"


@pytest.fixture(scope="module")
def http(stack):
    _, gw = stack
    with httpx.Client(base_url=gw.url, verify=client_ssl(gw.ca), timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def h2(stack):
    _, gw = stack
    with httpx.Client(base_url=gw.url, verify=client_ssl(gw.ca), timeout=TIMEOUT, http2=True) as c:
        yield c


def chat(model: str = M, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def assert_client_error(r: httpx.Response, *statuses: int) -> dict:
    """A 4xx in OpenAI's shape (`{"error": {"message", "type", "code"}}`), JSON typed."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if statuses:
        assert r.status_code in statuses, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert err["message"]
    return err


# --- bodies ----------------------------------------------------------------------------------

HUGE = b"9" * 5000
BAD_BODIES = {
    "invalid utf-8": b'{"model": "\xff\xfe", "messages": []}',
    "invalid utf-8 in content": b'{"model": "model-m", "messages": '
    b'[{"role": "user", "content": "\xc3\x28"}]}',
    "lone surrogate escape": b'{"model": "model-m\\ud800", "messages": '
    b'[{"role": "user", "content": "x"}]}',
    "deep array": b"[" * 100_000 + b"]" * 100_000,
    "deep object": b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    "deep messages": b'{"model": "model-m", "messages": ' + b"[" * 600 + b"]" * 600 + b"}",
    "unclosed": b'{"model": "model-m", "messages": [',
    "huge integer": b'{"model": "model-m", "messages": [], "max_tokens": ' + HUGE + b"}",
    "huge float": b'{"model": "model-m", "max_tokens": 1e400, "messages": []}',
    "max_tokens over int32": orjson.dumps(chat(max_tokens=2**40)),
    "negative max_tokens": orjson.dumps(chat(max_tokens=-1)),
    "NaN": b'{"model": "model-m", "temperature": NaN, "messages": []}',
    "model number": orjson.dumps({"model": 7, "messages": []}),
    "model list": orjson.dumps({"model": [M], "messages": []}),
    "model object": orjson.dumps({"model": {"name": M}, "messages": []}),
    "model null": orjson.dumps({"model": None, "messages": []}),
    "model bool": orjson.dumps({"model": True, "messages": []}),
    "model empty": orjson.dumps({"model": "", "messages": []}),
    "model missing": orjson.dumps({"messages": [{"role": "user", "content": "x"}]}),
    "messages string": orjson.dumps({"model": M, "messages": "hello"}),
    "messages object": orjson.dumps({"model": M, "messages": {"role": "user"}}),
    "messages empty": orjson.dumps({"model": M, "messages": []}),
    "messages of numbers": orjson.dumps({"model": M, "messages": [1, 2]}),
    "role number": orjson.dumps({"model": M, "messages": [{"role": 1, "content": "x"}]}),
    "content number": orjson.dumps({"model": M, "messages": [{"role": "user", "content": 5}]}),
    "stream string": orjson.dumps(chat(stream="yes")),
    "stream number": orjson.dumps(chat(stream=1)),
    "body is a list": b"[1, 2, 3]",
    "body is a string": b'"model-m"',
    "body is null": b"null",
    "body is a number": b"12",
    "body is whitespace": b"   \n\t ",
    "not json": b"model=model-m&prompt=hi",
    "binary": bytes(range(256)) * 4,
    "unknown model": orjson.dumps(chat("no-such-model")),
    "unknown model, 10 KB name": orjson.dumps(chat("x" * 10_000)),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_malformed_body_is_a_4xx_json_error(http, name):
    r = http.post(
        "/v1/chat/completions",
        content=BAD_BODIES[name],
        headers={"content-type": "application/json"},
    )
    err = assert_client_error(r, 400, 404)
    assert len(r.content) < 2048  # a 10 KB model name is not echoed back whole
    if name.startswith("unknown"):
        assert r.status_code == 404 and err["code"] == "model_not_found"


def test_malformed_bodies_over_http2(h2):
    for name in ("invalid utf-8", "deep array", "model number", "body is a list", "unknown model"):
        r = h2.post(
            "/v1/chat/completions",
            content=BAD_BODIES[name],
            headers={"content-type": "application/json"},
        )
        assert r.http_version == "HTTP/2"
        assert_client_error(r, 400, 404)


def test_duplicate_keys_route_on_the_value_the_pod_reads(http):
    """Last one wins, in the gateway as in the pod (orjson, Python's json): the model
    routed on is the model served, never a mismatch between the two."""
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "no-such", "model": "model-n", "max_tokens": 2,'
        b' "messages": [{"role": "user", "content": "x"}]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-pod"] == "n0"
    assert r.json()["model"] == N
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "model-m", "model": "no-such",'
        b' "messages": [{"role": "user", "content": "x"}]}',
        headers={"content-type": "application/json"},
    )
    assert_client_error(r, 404)


def test_empty_body(http):
    for headers in ({"content-type": "application/json"}, {}):
        r = http.post("/v1/chat/completions", content=b"", headers=headers)
        assert_client_error(r, 400)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/xml", "image/png"],
)  # fmt: skip
def test_non_json_content_type_is_415(http, content_type):
    r = http.post(
        "/v1/chat/completions", content=orjson.dumps(chat()), headers={"content-type": content_type}
    )
    assert_client_error(r, 415)


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate", "zstd", "gzip, identity"])
def test_compressed_body_is_415_with_accept_encoding(http, coding):
    body = gzip.compress(orjson.dumps(chat())) if coding.startswith("gzip") else b"\x28\xb5\x2f"
    r = http.post(
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", "content-encoding": coding},
    )
    err = assert_client_error(r, 415)
    assert err["code"] == "unsupported_content_encoding"
    assert r.headers["accept-encoding"] == "identity"


def _chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_chunked_uploads(http):
    """Chunked transfer encoding (no content-length): buffered by Envoy, then judged."""
    ok = http.post(
        "/v1/chat/completions",
        content=_chunks(orjson.dumps(chat()), 7),
        headers={"content-type": "application/json"},
    )
    assert ok.status_code == 200, ok.text
    assert "content-length" not in ok.request.headers
    bad = http.post(
        "/v1/chat/completions",
        content=_chunks(b'{"model": "model-m", "messages": [', 3),
        headers={"content-type": "application/json"},
    )
    assert_client_error(bad, 400)
    big = http.post(
        "/v1/chat/completions",
        content=_chunks(b'{"model": "model-m", "pad": "' + b"a" * (BODY_LIMIT + 10) + b'"}', 65536),
        headers={"content-type": "application/json"},
    )
    assert_client_error(big, 413)


@pytest.mark.parametrize("size", [BODY_LIMIT + 1, 4 * BODY_LIMIT])
def test_oversize_body_is_413(stack, http, size):
    body = b'{"model": "model-m", "pad": "' + b"a" * size + b'"}'
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert assert_client_error(r, 413)["code"] == "request_too_large"
    # Over HTTP/2 the 413 (JSON) comes while the client still sends; Envoy ends the
    # stream and resets it with NO_ERROR (RFC 9113 §8.1). httpx and curl 7.88 drop such
    # an early answer, so a raw h2 client reads it: declared length (the picker refuses
    # it from the headers) and chunked (Envoy refuses it at the buffer limit).
    for declared in (True, False):
        status, data, reset = _h2_post(stack[1], body, declare_length=declared)
        assert status == 413, (declared, status, data[:200])
        assert json.loads(data)["error"]["code"] == "request_too_large"
        assert reset in (None, 0)


def _h2_post(gw, body: bytes, declare_length: bool) -> tuple[int, bytes, int | None]:
    """POST over a raw HTTP/2 connection, sending while the window allows and reading
    whatever comes back: (status, response body, RST_STREAM error code or None)."""
    import h2.config
    import h2.connection
    import h2.events

    ctx = client_ssl(gw.ca)
    ctx.set_alpn_protocols(["h2"])
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "https"),
               (":authority", "localhost"), ("content-type", "application/json")]  # fmt: skip
    if declare_length:
        headers.append(("content-length", str(len(body))))
    status, data, reset, sent = 0, b"", None, 0
    with (
        socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        conn.initiate_connection()
        conn.send_headers(1, headers)
        tls.sendall(conn.data_to_send())
        tls.settimeout(0.2)
        deadline = time.monotonic() + TIMEOUT
        ended = False
        while time.monotonic() < deadline and not ended:
            while status == 0 and sent < len(body) and conn.local_flow_control_window(1) > 0:
                n = min(conn.local_flow_control_window(1), 16384, len(body) - sent)
                conn.send_data(1, body[sent : sent + n], end_stream=sent + n == len(body))
                sent += n
                tls.sendall(conn.data_to_send())
            try:
                chunk = tls.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamReset):
                    reset, ended = event.error_code, True
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            tls.sendall(conn.data_to_send())
    return status, data, reset


def test_oversize_declared_length_is_refused_before_the_body(stack):
    """A Content-Length over the limit is answered at once (the picker sees the
    headers first), not after buffering, nor never (the body here never comes)."""
    _, gw = stack
    ctx = client_ssl(gw.ca)
    with (
        socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
            b"content-type: application/json\r\n"
            + f"content-length: {50 * BODY_LIMIT}\r\n\r\n".encode()
            + b'{"model": "model-m"'
        )
        head = tls.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


@pytest.mark.parametrize(
    "headers",
    [
        {"x-long": "a" * 100_000},
        {"x-long": "a" * 70_000},
        {f"x-h{i}": "v" for i in range(150)},
        {"authorization": "Bearer " + "a" * 80_000},
    ],
    ids=["100KB-header", "70KB-header", "150-headers", "80KB-auth"],
)
def test_very_long_headers_are_431(http, headers):
    r = http.post("/v1/chat/completions", json=chat(), headers=headers)
    err = assert_client_error(r, 431)
    assert err["code"] == "headers_too_large"


def _raw_request(gw, head: bytes) -> bytes:
    ctx = client_ssl(gw.ca)
    with (
        socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(head)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = tls.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_very_long_path(stack, http):
    _, gw = stack
    body = orjson.dumps(chat())
    head = _raw_request(
        gw,
        b"POST /v1/chat/completions?"
        + b"a" * 100_000
        + b" HTTP/1.1\r\nhost: localhost\r\n"
        + b"content-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    assert head.startswith((b"HTTP/1.1 431", b"HTTP/1.1 414")), head[:200]
    assert b"content-type: application/json" in head.lower()
    r = http.post("/v1/" + "x" * 5000, json=chat())
    assert_client_error(r, 404)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
def test_other_methods_on_the_api_path_are_405(http, method):
    body = orjson.dumps(chat()) if method in ("PUT", "PATCH", "DELETE") else None
    r = http.request(method, "/v1/chat/completions", content=body)
    if method == "HEAD":
        assert r.status_code == 405
        return
    err = assert_client_error(r, 405)
    assert err["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


def test_unknown_paths_are_404(http):
    for method, path in (("POST", "/v1/chat/completion"), ("GET", "/v1/models/x"), ("GET", "/")):
        r = http.request(method, path, content=orjson.dumps(chat()) if method == "POST" else None)
        assert_client_error(r, 404)


def test_garbage_instead_of_http(stack):
    _, gw = stack
    ctx = client_ssl(gw.ca)
    for garbage in (
        b"\x00\x01\x02\x03" * 64 + b"\r\n\r\n",
        b"POST / HTTP/9.9\r\n\r\n",
        b"GET\r\n\r\n",
    ):
        with (
            socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            tls.sendall(garbage)
            head = tls.recv(4096)
        assert head == b"" or head.startswith(b"HTTP/1.1 4"), head[:200]


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
KEYS = st.sampled_from(
    ["model", "messages", "stream", "max_tokens", "role", "content", "prompt", "x"]
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(KEYS, c, max_size=4),
    max_leaves=16,
)
MODELS = st.sampled_from([M, N, "", "nope"]) | JSON_SCALARS
BODIES = st.one_of(
    st.binary(max_size=300),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"model": MODELS},
        optional={"messages": JSON_VALUES, "stream": JSON_SCALARS, "max_tokens": JSON_SCALARS},
    ).map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]))
def test_random_bodies_never_5xx(http, body, path):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, body, r.text[:300])
    if r.status_code >= 400:
        if "x-sim-pod" in r.headers:  # accepted by the gateway, refused by the pod itself
            assert "message" in r.json()
        else:
            assert_client_error(r)


# --- routing headers -------------------------------------------------------------------------


def test_client_routing_headers_are_never_honoured(stack, http, h2):
    fleet, gw = stack
    targets = [
        fleet.address("n0"),  # a pod of the other pool
        f"127.0.0.1:{gw.ports['envoyAdmin']}",
        f"127.0.0.1:{gw.ports['picker']}",
        f"127.0.0.1:{gw.ports['metrics']}",
        f"{fleet.address('n0')},{fleet.address('m0')}",
    ]
    for client in (http, h2):
        for target in targets:
            r = client.post(
                "/v1/chat/completions",
                json=chat(M),
                headers={
                    "x-gateway-destination-endpoint": target,
                    "x-gateway-pool": "n",
                    "x-gateway-model-name": N,
                    "x-gateway-base-model-name": N,
                },
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-sim-pod"] == "m0"
            assert r.json()["model"] == M


def test_admin_and_ext_proc_ports_listen_on_loopback_only(stack):
    _, gw = stack
    pids = children(gw.proc.pid)
    picker = listening_sockets(pids["picker"])
    envoy = listening_sockets(pids["envoy"])
    ports = gw.ports
    assert {p for _, p in picker} == {ports["picker"], ports["admin"], ports["metrics"]}, picker
    assert all(_loopback(addr) for addr, _ in picker), picker
    others = {(a, p) for a, p in envoy if p != ports["listen"]}
    assert {p for _, p in others} == {ports["envoyAdmin"]}, envoy
    assert all(_loopback(addr) for addr, _ in others), envoy


def _loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (grpc binds those)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


# --- TLS -------------------------------------------------------------------------------------


def _handshake(gw, context: ssl.SSLContext) -> tuple[str, str]:
    with (
        socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        return tls.version(), tls.cipher()[0]


def test_tls_floor_and_modern_suites_only(stack):
    _, gw = stack
    default = client_ssl(gw.ca)
    assert _handshake(gw, default)[0] == "TLSv1.3"
    for cipher in ("ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-CHACHA20-POLY1305"):
        ctx = client_ssl(gw.ca)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(cipher)
        assert _handshake(gw, ctx) == ("TLSv1.2", cipher)
    for weak in ("ECDHE-ECDSA-AES128-SHA", "AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-SHA384"):
        ctx = client_ssl(gw.ca)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(f"{weak}:@SECLEVEL=0")
        with pytest.raises(ssl.SSLError):
            _handshake(gw, ctx)
    old = client_ssl(gw.ca)
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError):
        _handshake(gw, old)


def _served_serial(gw) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", gw.ports["listen"]), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_generated_certificate_reloads_without_restart(stack):
    _, gw = stack
    envoy = children(gw.proc.pid)["envoy"]
    old = _served_serial(gw)
    ca = load_ca(gw.state_dir)
    assert ca is not None
    new = issue_server_cert(generated_files(gw.state_dir), ca, ("localhost", "127.0.0.1"))
    took = wait_for(lambda: _served_serial(gw) == new.serial_number, 5, "the new certificate")
    assert new.serial_number != old
    assert children(gw.proc.pid)["envoy"] == envoy
    with httpx.Client(base_url=gw.url, verify=client_ssl(gw.ca), timeout=TIMEOUT) as c:
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200
    print(f"\nFIGURES cert_reload_generated: served_after_s={took:.3f}")


def test_user_certificate_files_reload_without_restart(tmp_path):
    """spec.tls names the files (as a Kubernetes secret mount would provide them):
    replacing them by rename is picked up by the running gateway."""
    user = tmp_path / "secret"
    files = ensure_self_signed(user, ("localhost", "127.0.0.1"))
    with sim_fleet(tmp_path, PODS[:1], time_scale=20.0) as fleet:
        config = gateway_config(
            [{"name": "m", "modelName": M, "endpoints": fleet.addresses()}],
            tls={"certificateFile": str(files.cert), "keyFile": str(files.key)},
        )
        with gateway(tmp_path, config) as gw:
            envoy = children(gw.proc.pid)["envoy"]
            verify = client_ssl(files.ca_cert)
            with httpx.Client(base_url=gw.url, verify=verify, timeout=TIMEOUT) as c:
                assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            old = _served_serial(gw)
            new = issue_server_cert(files, load_ca(user), ("localhost", "127.0.0.1"))
            took = wait_for(lambda: _served_serial(gw) == new.serial_number, 5, "new certificate")
            assert new.serial_number != old
            assert children(gw.proc.pid)["envoy"] == envoy
            with httpx.Client(base_url=gw.url, verify=verify, timeout=TIMEOUT) as c:
                assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            print(f"\nFIGURES cert_reload_user_files: served_after_s={took:.3f}")


# --- JWT -------------------------------------------------------------------------------------


def test_jwt_rejects_before_the_picker(tmp_path: Path):
    key = ec.generate_private_key(ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(jwks(key)))
    now = int(time.time())
    claims = {"iss": "https://issuer.test", "aud": "igw", "sub": "u", "exp": now + 600}
    bad_tokens = {
        "none": None,
        "garbage": "not-a-jwt",
        "other key": es256_token(ec.generate_private_key(ec.SECP256R1()), claims),
        "expired": es256_token(key, {**claims, "exp": now - 3600}),
        "wrong issuer": es256_token(key, {**claims, "iss": "https://evil.test"}),
        "alg none": b64url(b'{"alg":"none","typ":"JWT"}')
        + "."
        + b64url(json.dumps(claims).encode())
        + ".",
    }
    with sim_fleet(tmp_path, PODS[:1], time_scale=20.0) as fleet:
        config = gateway_config(
            [{"name": "m", "modelName": M, "endpoints": fleet.addresses()}],
            auth={
                "jwt": {
                    "issuer": "https://issuer.test",
                    "audiences": ["igw"],
                    "jwksFile": str(jwks_file),
                }
            },
        )
        with (
            gateway(tmp_path, config) as gw,
            httpx.Client(base_url=gw.url, verify=client_ssl(gw.ca), timeout=TIMEOUT) as c,
        ):
            admin = gw.ports["envoyAdmin"]
            before = envoy_stat(admin, "cluster.picker.upstream_rq_total") or 0
            for name, token in bad_tokens.items():
                headers = {"authorization": f"Bearer {token}"} if token else {}
                r = c.post("/v1/chat/completions", json=chat(), headers=headers)
                err = assert_client_error(r, 401)
                assert err["type"] == "authentication_error", name
            r = c.post(
                "/v1/chat/completions",
                json=chat(),
                headers={"authorization": f"Bearer {es256_token(key, {**claims, 'aud': 'other'})}"},
            )
            assert_client_error(r, 403)
            assert (envoy_stat(admin, "cluster.picker.upstream_rq_total") or 0) == before
            assert c.get("/healthz").status_code == 200
            good = {"authorization": f"Bearer {es256_token(key, claims)}"}
            r = c.post("/v1/chat/completions", json=chat(), headers=good)
            assert r.status_code == 200, r.text
            assert (envoy_stat(admin, "cluster.picker.upstream_rq_total") or 0) > before
