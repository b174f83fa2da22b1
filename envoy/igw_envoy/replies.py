"""What Envoy itself answers with, and what it logs: OpenAI-style errors, JSON access log.

Clients of an OpenAI-compatible API parse `{"error": {"message", "type",
"code"}}`; Envoy's own replies (413 body too large, 503 no healthy upstream or
picker failure, 504 upstream timeout, 401 from JWT, ...) are plain text by
default. `local_reply_config` rewrites them.

Every local reply passes through those mappers, including the immediate
responses the picker sends through ext_proc, which already carry the
gateway's JSON body. The first mapper therefore matches exactly those and
changes nothing (no top-level `body_format` is set, so a reply no mapper
rewrites keeps its body). Measured on Envoy 1.40: an ImmediateResponse
without `details` reaches the mappers with empty response-code details
(every Envoy-generated reply has non-empty details: `no_healthy_upstream`,
`request_payload_too_large`, `direct_response`, `ext_proc_error_...`), and the
immediate response's own headers are already on the response the mapper
filter sees. A reply is the picker's when its details are empty or start
with `igw_`, or when it already has `content-type: application/json`.
"""

from __future__ import annotations

from dataclasses import dataclass

CEL_FILTER = "envoy.access_loggers.extension_filters.cel"
CEL_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"

# Details prefix the picker may use in ImmediateResponse.details (or leave it empty).
PICKER_DETAILS_PREFIX = "igw_"


@dataclass(frozen=True)
class ErrorKind:
    """How one status code Envoy produces is presented to an OpenAI client."""

    status: int
    type: str
    code: str
    message: str | None = None  # None: keep Envoy's own text
    retry_after: bool = False


def error_kinds(max_body_bytes: int) -> tuple[ErrorKind, ...]:
    """Every status Envoy may generate locally, with its OpenAI error type."""
    return (
        ErrorKind(400, "invalid_request_error", "bad_request"),
        ErrorKind(401, "authentication_error", "invalid_token"),
        ErrorKind(403, "permission_error", "forbidden"),
        ErrorKind(404, "invalid_request_error", "not_found"),
        ErrorKind(408, "invalid_request_error", "request_timeout"),
        ErrorKind(
            413,
            "invalid_request_error",
            "request_too_large",
            f"request body is larger than the gateway limit of {max_body_bytes} bytes",
        ),
        ErrorKind(429, "rate_limit_error", "rate_limited", retry_after=True),
        ErrorKind(431, "invalid_request_error", "headers_too_large", "request headers too large"),
        ErrorKind(500, "server_error", "internal_error"),
        ErrorKind(502, "server_error", "bad_gateway"),
        ErrorKind(503, "server_error", "service_unavailable", retry_after=True),
        ErrorKind(504, "server_error", "upstream_timeout"),
    )


def picker_reply_expression() -> str:
    """CEL: true for a local reply the picker produced (leave it alone)."""
    return (
        'response.code_details == ""'
        f' || response.code_details.startsWith("{PICKER_DETAILS_PREFIX}")'
        ' || ("content-type" in response.headers'
        ' && response.headers["content-type"].startsWith("application/json"))'
    )


def _cel(expression: str) -> dict:
    return {
        "extension_filter": {
            "name": CEL_FILTER,
            "typed_config": {"@type": CEL_TYPE, "expression": expression},
        }
    }


def _status_filter(op: str, status: int) -> dict:
    return {
        "status_code_filter": {
            "comparison": {
                "op": op,
                "value": {
                    "default_value": status,
                    "runtime_key": f"igw.local_reply.{op.lower()}_{status}",
                },
            }
        }
    }


def _json_error(error_type: str, code: str) -> dict:
    return {
        "json_format": {
            "error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type, "code": code}
        },
        "content_type": "application/json",
    }


def _mapper(kind: ErrorKind) -> dict:
    mapper: dict = {
        "filter": _status_filter("EQ", kind.status),
        "body_format_override": _json_error(kind.type, kind.code),
    }
    if kind.message is not None:
        mapper["body"] = {"inline_string": kind.message}
    if kind.retry_after:
        mapper["headers_to_add"] = [_retry_after()]
    return mapper


def _retry_after() -> dict:
    return {
        "header": {"key": "retry-after", "value": "1"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }


def picker_failure_mapper() -> dict:
    """The picker could not answer and failure mode is closed.

    ext_proc replies `status_on_error` (503) with an empty body when the
    stream fails (picker down, gRPC error), but 504 when the picker is just
    slow (`message_timeout`); details start with `ext_proc_error` in both
    cases. Both become the same 503 with a message and Retry-After: for the
    client it is one condition, "the gateway cannot route right now".
    """
    return {
        "filter": _cel('response.code_details.startsWith("ext_proc_error")'),
        "status_code": 503,
        "body": {"inline_string": "the endpoint picker is unavailable; retry shortly"},
        "body_format_override": _json_error("server_error", "picker_unavailable"),
        "headers_to_add": [_retry_after()],
    }


def local_reply_config(max_body_bytes: int) -> dict:
    """HCM `local_reply_config`: picker replies untouched, Envoy's errors as OpenAI JSON."""
    mappers: list[dict] = [{"filter": _cel(picker_reply_expression())}, picker_failure_mapper()]
    mappers += [_mapper(kind) for kind in error_kinds(max_body_bytes)]
    # Anything else Envoy generates: 5xx is the gateway's fault, 4xx the request's.
    mappers.append(
        {
            "filter": _status_filter("GE", 500),
            "body_format_override": _json_error("server_error", "gateway_error"),
        }
    )
    mappers.append(
        {
            "filter": _status_filter("GE", 400),
            "body_format_override": _json_error("invalid_request_error", "invalid_request"),
        }
    )
    return {"mappers": mappers}


ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "model": "%REQ(X-GATEWAY-MODEL-NAME)%",
    "pool": "%REQ(X-GATEWAY-POOL)%",
    "upstream_host": "%UPSTREAM_HOST%",
    "status": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "duration_ms": "%DURATION%",
    "upstream_service_time_ms": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "client": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
    "user_agent": "%REQ(USER-AGENT)%",
}


STDOUT_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
FILE_LOG_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def access_log(path: str | None, skip_path: str | None = None) -> list[dict]:
    """One JSON line per request, to stdout (path None) or a file; none for requests to
    `skip_path` (Tier 1: the global router's load-summary polls, several a second)."""
    log_format = {"json_format": ACCESS_LOG_FORMAT}
    if path is None:
        config = {"@type": STDOUT_LOG_TYPE, "log_format": log_format}
        entry = {"name": "envoy.access_loggers.stdout", "typed_config": config}
    else:
        config = {"@type": FILE_LOG_TYPE, "path": path, "log_format": log_format}
        entry = {"name": "envoy.access_loggers.file", "typed_config": config}
    if skip_path is not None:
        entry["filter"] = {"header_filter": {"header": {
            "name": ":path", "string_match": {"exact": skip_path}, "invert_match": True,
        }}}
    return [entry]
