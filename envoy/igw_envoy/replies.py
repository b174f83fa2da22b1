"""What Envoy itself answers with, and what it logs: OpenAI-style errors, JSON access log.

Clients of an OpenAI-compatible API parse `{"error": {"message", "type",
"code"}}`; Envoy's own replies (413 body too large, 503 no healthy upstream or
picker failure, 504 upstream timeout, 401 from JWT, ...) are plain text by
default. `local_reply_config` rewrites them.

Every local reply passes through those mappers, including the immediate
responses the picker sends through ext_proc, which already carry the
gateway's JSON body. The first mapper therefore matches exactly those
(Envoy tags them with response-code details `ext_proc_immediate_response`
unless the picker gives its own details; see PICKER_DETAILS) and changes
nothing; no top-level `body_format` is set, so an unmatched reply keeps its
body and headers.
"""

from __future__ import annotations

from dataclasses import dataclass

CEL_FILTER = "envoy.access_loggers.extension_filters.cel"
CEL_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"

# Response-code details of a picker's immediate response. Envoy uses the
# ImmediateResponse `details` string when the picker sets one, else this.
# The picker should leave `details` empty or start it with "igw_".
PICKER_DETAILS = ("ext_proc_immediate_response", "igw_")


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
    tests = [f'response.code_details.startsWith("{prefix}")' for prefix in PICKER_DETAILS]
    return " || ".join(tests)


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
            "comparison": {"op": op, "value": {"default_value": status, "runtime_key": f"igw.status_{status}"}}
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


def local_reply_config(max_body_bytes: int) -> dict:
    """HCM `local_reply_config`: picker replies untouched, Envoy's errors as OpenAI JSON."""
    mappers: list[dict] = [{"filter": _cel(picker_reply_expression())}]
    mappers += [_mapper(kind) for kind in error_kinds(max_body_bytes)]
    mappers.append(
        {
            "filter": _status_filter("GE", 400),
            "body_format_override": _json_error("server_error", "gateway_error"),
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


def access_log(path: str | None) -> list[dict]:
    """One JSON line per request, to stdout (path None) or a file."""
    log_format = {"json_format": ACCESS_LOG_FORMAT}
    if path is None:
        return [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": log_format,
                },
            }
        ]
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": path,
                "log_format": log_format,
            },
        }
    ]
