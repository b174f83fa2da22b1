"""Body-based routing: one parse of the request body into what routing needs.

`parse_request` runs once per request on the picker's hot path. It checks the
path, hands the bytes to the JSON guard (bbr.json_body: size, content headers,
nesting, one orjson parse), validates the fields routing reads or that a client
commonly gets wrong, and has bbr.prompt flatten the prompt into the text used
for prefix affinity. Every client mistake becomes an `ApiError`
(400/404/413/415); nothing else escapes.

The parsed body is kept on the result (`InferenceRequest.body`) so no later
step ever parses it again. See docs/bbr.md for the full contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bbr.json_body import kind, read_object
from bbr.prompt import prompt_text
from contract.errors import InvalidRequest, NotFound, echo

__all__ = [
    "API_PATHS",
    "DEFAULT_MAX_TOKENS",
    "MAX_TOKENS_LIMIT",
    "InferenceRequest",
    "parse_request",
]

API_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
# Output budget assumed when the client sets none (vLLM's own default is "the
# rest of the context", unknown here; 256 is a typical chat answer).
DEFAULT_MAX_TOKENS = 256
# Token counts go into int64 numpy arrays downstream: keep them far from overflow.
MAX_TOKENS_LIMIT = 2**31 - 1
# The fields each API reads its output budget from, first set wins (all are
# validated); None: the API generates no tokens (an embedding).
_MAX_TOKENS_FIELDS: dict[str, tuple[str, ...] | None] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "embeddings": None,
    "responses": ("max_output_tokens",),
}


@dataclass(slots=True)
class InferenceRequest:
    """What routing needs from one request body, read in one parse.

    `prompt` is the text used for prefix affinity, capped at `PROMPT_CHAR_CAP`
    characters; `prompt_tokens` estimates the whole prompt (ceil(chars / 4)).
    `adapter` and `base_model` are filled by `ModelMap.apply` once the model is
    resolved; until then `base_model` equals `model`.
    """

    model: str
    api: str
    stream: bool
    prompt: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None = None
    base_model: str = ""
    body: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def _api_for_path(path: str) -> str:
    route = path.partition("?")[0]
    if len(route) > 1 and route.endswith("/"):
        route = route[:-1]
    api = API_PATHS.get(route)
    if api is None:
        raise NotFound(
            f"Invalid URL (`{echo(route)}`): the gateway routes POST "
            + ", ".join(API_PATHS)
            + " and GET /v1/models."
        )
    return api


# ---------------------------------------------------------------- common fields


def _model(data: dict[str, Any]) -> str:
    model = data.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model")
    if type(model) is not str:
        raise InvalidRequest(f"`model` must be a string, not {kind(model)}.", param="model")
    if not model:
        raise InvalidRequest("`model` must not be empty.", param="model")
    return model


def _stream(data: dict[str, Any]) -> bool:
    stream = data.get("stream")
    if stream is None:  # absent or null: OpenAI's optional params are nullable
        return False
    if type(stream) is not bool:
        raise InvalidRequest(f"`stream` must be a boolean, not {kind(stream)}.", param="stream")
    return stream


def _token_limit(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidRequest(
            f"`{key}` must be a non-negative integer, not {_describe(value)}.", param=key
        )
    if value > MAX_TOKENS_LIMIT:
        raise InvalidRequest(f"`{key}` must be at most {MAX_TOKENS_LIMIT}.", param=key)
    return value


def _describe(value: object) -> str:
    return f"{value}" if type(value) is int else kind(value)


def _max_tokens(data: dict[str, Any], api: str) -> int:
    """The output budget: first of the API's fields the client set (all are
    validated), else DEFAULT_MAX_TOKENS; 0 for an API that generates nothing."""
    keys = _MAX_TOKENS_FIELDS[api]
    if keys is None:
        return 0
    chosen: int | None = None
    for key in keys:
        value = _token_limit(data, key)
        if chosen is None:
            chosen = value
    return DEFAULT_MAX_TOKENS if chosen is None else chosen


# ---------------------------------------------------------------- entry point


def parse_request(
    body: bytes | bytearray | memoryview,
    path: str,
    content_type: str | None,
    content_encoding: str | None,
    limit: int,
) -> InferenceRequest:
    """Parse one request body (once) into an InferenceRequest, or raise an ApiError.

    Order: path (404), size (413) and empty body (400), content headers (415),
    nesting guard (400), JSON parse (400), then `model`, `stream`, the prompt
    fields of the API the path names, and its output-token fields (400).
    """
    api = _api_for_path(path)
    data = read_object(body, content_type, content_encoding, limit)
    model = _model(data)
    stream = _stream(data)
    prompt, chars = prompt_text(api, data)
    max_tokens = _max_tokens(data, api)
    return InferenceRequest(
        model=model,
        api=api,
        stream=stream,
        prompt=prompt,
        prompt_tokens=(chars + 3) // 4,
        max_tokens=max_tokens,
        adapter=None,
        base_model=model,
        body=data,
    )
