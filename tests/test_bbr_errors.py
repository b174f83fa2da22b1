"""contract.errors: status, OpenAI-shaped body and headers for every client-visible error."""

from __future__ import annotations

import orjson
import pytest

from contract.errors import (
    ApiError,
    BodyTooLarge,
    InvalidRequest,
    ModelNotFound,
    NoReadyEndpoint,
    NotFound,
    Overloaded,
    QueueTimeout,
    Unauthorized,
    UnsupportedContentEncoding,
    UnsupportedMediaType,
    error_body,
    error_headers,
)

CASES = [
    (InvalidRequest("bad"), 400, "invalid_request_error", "invalid_request", None),
    (Unauthorized("who?"), 401, "invalid_request_error", "invalid_api_key", None),
    (NotFound("nope"), 404, "invalid_request_error", "unknown_url", None),
    (ModelNotFound("x"), 404, "invalid_request_error", "model_not_found", None),
    (BodyTooLarge("big"), 413, "invalid_request_error", "request_too_large", None),
    (UnsupportedMediaType("xml"), 415, "invalid_request_error", "unsupported_media_type", None),
    (UnsupportedContentEncoding("gz"), 415, "invalid_request_error",
     "unsupported_content_encoding", None),
    (Overloaded("busy"), 429, "rate_limit_error", "overloaded", "1"),
    (NoReadyEndpoint("none"), 503, "server_error", "no_ready_endpoint", "1"),
    (QueueTimeout("waited"), 503, "server_error", "queue_timeout", "1"),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "status", "etype", "code", "retry"), CASES)
def test_status_body_headers(
    exc: ApiError, status: int, etype: str, code: str, retry: str | None
) -> None:
    assert exc.status == status
    body = orjson.loads(error_body(exc))
    assert body == {
        "error": {"message": exc.message, "type": etype, "param": exc.param, "code": code}
    }
    headers = dict(error_headers(exc))
    assert headers["content-type"] == "application/json"
    assert headers.get("retry-after") == retry
    assert isinstance(exc, ApiError)


def test_body_key_order_is_openai_order() -> None:
    assert list(orjson.loads(error_body(InvalidRequest("m")))["error"]) == [
        "message",
        "type",
        "param",
        "code",
    ]


def test_model_not_found_names_the_model_like_openai() -> None:
    exc = ModelNotFound("llama-9")
    assert exc.message == "The model `llama-9` does not exist or you do not have access to it."
    assert exc.param == "model"
    assert exc.model == "llama-9"


def test_model_not_found_message_is_bounded() -> None:
    exc = ModelNotFound("m" * 1_000_000)
    assert len(error_body(exc)) < 1000


def test_retry_after_override_and_param() -> None:
    exc = Overloaded("busy", retry_after=7)
    assert ("retry-after", "7") in error_headers(exc)
    exc = InvalidRequest("bad stream", param="stream")
    assert orjson.loads(error_body(exc))["error"]["param"] == "stream"
    assert QueueTimeout("q", retry_after=3).retry_after == 3


def test_no_ready_endpoint_names_pool() -> None:
    exc = NoReadyEndpoint.for_pool("llama-pool", "llama")
    assert "llama-pool" in exc.message and "llama" in exc.message
    assert exc.retry_after == 1


def test_message_escaping() -> None:
    exc = InvalidRequest('quote " backslash \\ newline \n unicode é \u2028')
    assert orjson.loads(error_body(exc))["error"]["message"] == exc.message


def test_extra_headers() -> None:
    assert ("www-authenticate", "Bearer") in error_headers(Unauthorized("no token"))
    assert ("accept-encoding", "identity") in error_headers(UnsupportedContentEncoding("gzip"))
    assert isinstance(UnsupportedContentEncoding("gzip"), UnsupportedMediaType)


def test_base_api_error_is_a_500() -> None:
    exc = ApiError("boom")
    assert exc.status == 500
    assert orjson.loads(error_body(exc))["error"] == {
        "message": "boom",
        "type": "server_error",
        "param": None,
        "code": None,
    }
