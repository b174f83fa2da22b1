"""Every error a client can see, as a typed exception mapped once to an HTTP answer.

Lower layers raise an `ApiError` subclass; the handler turns it into a response in
one place with `error_body` / `error_headers`. The body has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) so SDKs built for OpenAI show
the message and pick the right exception class from the status code.

The parts that never change per class (type, code, status) are JSON-encoded once
when the class is defined: under overload the gateway may shed thousands of
requests a second, and a 429 should cost less than the request it refuses.
"""

from __future__ import annotations

from typing import ClassVar

import orjson

__all__ = [
    "ApiError",
    "BodyTooLarge",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoEligibleRegion",
    "NoReadyEndpoint",
    "NotFound",
    "Overloaded",
    "QueueTimeout",
    "Unauthorized",
    "UnsupportedContentEncoding",
    "UnsupportedMediaType",
    "error_body",
    "error_headers",
]

JSON_CONTENT_TYPE = ("content-type", "application/json")
# Names echoed back into messages are cut: a 1 MB "model" must not make a 1 MB 404.
MAX_ECHO_CHARS = 200


def echo(value: str, limit: int = MAX_ECHO_CHARS) -> str:
    """A client-supplied string, shortened for an error message."""
    return value if len(value) <= limit else value[:limit] + "…"


def _fragment(key: str, value: str | None) -> bytes:
    return b',"' + key.encode() + b'":' + orjson.dumps(value)


class ApiError(Exception):
    """Base of every client-visible error: a status, an OpenAI error type and code.

    `retry_after` (seconds) becomes a `Retry-After` header; `param` names the
    offending request field, as OpenAI does.
    """

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    default_retry_after: ClassVar[int | None] = None
    extra_headers: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Pre-encoded `,"type":...` and `,"code":...` parts, filled by __init_subclass__.
    _type_json: ClassVar[bytes] = _fragment("type", "server_error")
    _code_json: ClassVar[bytes] = _fragment("code", None)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._type_json = _fragment("type", cls.error_type)
        cls._code_json = _fragment("code", cls.code)

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = self.default_retry_after if retry_after is None else retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


class InvalidRequest(ApiError):
    """400: the body or a header is malformed (bad JSON, wrong field type, ...)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ApiError):
    """401: missing or invalid credentials (only when auth is configured)."""

    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"
    extra_headers = (("www-authenticate", "Bearer"),)


class NotFound(ApiError):
    """404: a path the gateway does not route (OpenAI answers "Invalid URL")."""

    status = 404
    error_type = "invalid_request_error"
    code = "unknown_url"


class MethodNotAllowed(ApiError):
    """405: the inference paths take POST only (OpenAI answers the same)."""

    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"
    extra_headers = (("allow", "POST"),)


class ModelNotFound(ApiError):
    """404: no scheduler serves the requested model (OpenAI's wording and code)."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{echo(model)}` does not exist or you do not have access to it.",
            param="model",
        )
        self.model = model


class BodyTooLarge(ApiError):
    """413: the body exceeds `bbr.maxRequestBodyBytes`."""

    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ApiError):
    """415: the body is declared as something other than JSON.

    vLLM refuses a non-JSON media type too (415 in older versions, 400 in newer
    ones); the gateway refuses it before spending a pick on it.
    """

    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class UnsupportedContentEncoding(UnsupportedMediaType):
    """415 for a compressed body: the gateway reads `model` without decompressing.

    RFC 7694: answer an unsupported content coding with 415 and say which
    codings are accepted (`Accept-Encoding: identity`).
    """

    code = "unsupported_content_encoding"
    extra_headers = (("accept-encoding", "identity"),)


class Overloaded(ApiError):
    """429: every pod is saturated and the request is sheddable, or the queue is full."""

    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"
    default_retry_after = 1


class NoReadyEndpoint(ApiError):
    """503: the model's pool has no ready pod right now."""

    status = 503
    error_type = "server_error"
    code = "no_ready_endpoint"
    default_retry_after = 1

    @classmethod
    def for_pool(cls, pool: str, model: str | None = None) -> NoReadyEndpoint:
        """The standard message, naming the pool (and the model when known)."""
        who = f" for model `{echo(model)}`" if model else ""
        return cls(f"No ready endpoint{who} in pool `{pool}`; retry shortly.")


class NoEligibleRegion(NoReadyEndpoint):
    """503 from the global router: no region may take the request now; the message names
    the constraint that left none (fresh summary, ready pod, drain, residency, the
    client's `x-gateway-regions`)."""

    code = "no_eligible_region"


class QueueTimeout(ApiError):
    """503: the request waited in admission longer than the pool's queue timeout."""

    status = 503
    error_type = "server_error"
    code = "queue_timeout"
    default_retry_after = 1


_BODY_HEAD = b'{"error":{"message":'
_PARAM_KEY = b',"param":'
_BODY_TAIL = b"}}"
_NULL = b"null"


def error_body(exc: ApiError) -> bytes:
    """The OpenAI-style JSON body: `{"error": {"message", "type", "param", "code"}}`."""
    param = _NULL if exc.param is None else orjson.dumps(exc.param)
    return b"".join(
        (
            _BODY_HEAD,
            orjson.dumps(exc.message),
            exc._type_json,
            _PARAM_KEY,
            param,
            exc._code_json,
            _BODY_TAIL,
        )
    )


def error_headers(exc: ApiError) -> list[tuple[str, str]]:
    """Response headers: JSON content type, `Retry-After` when set, class extras."""
    headers = [JSON_CONTENT_TYPE]
    if exc.retry_after is not None:
        headers.append(("retry-after", str(max(0, int(exc.retry_after)))))
    if exc.extra_headers:
        headers.extend(exc.extra_headers)
    return headers
