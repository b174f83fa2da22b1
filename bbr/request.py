"""Body-based routing: one parse of the request body into what routing needs.

`parse_request` runs once per request on the picker's hot path. It checks the
cheap things first (path, size, content headers), parses the JSON once with
orjson, validates only the fields routing reads or that a client commonly gets
wrong, and flattens the prompt into the text used for prefix affinity. Every
client mistake becomes an `ApiError` (400/404/413/415); nothing else escapes.

The parsed body is kept on the result (`InferenceRequest.body`) so no later
step ever parses it again. See docs/bbr.md for the full contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from bbr.errors import (
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    UnsupportedContentEncoding,
    UnsupportedMediaType,
    echo,
)

__all__ = [
    "API_PATHS",
    "DEFAULT_MAX_TOKENS",
    "MAX_NESTING",
    "MAX_TOKENS_LIMIT",
    "PROMPT_CHAR_CAP",
    "InferenceRequest",
    "max_nesting_depth",
    "parse_request",
]

API_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
# Prompt text kept for prefix hashing (characters). Token estimates still count
# the whole prompt; only the kept text is capped. 256 KiB = 4096 blocks of 64.
PROMPT_CHAR_CAP = 256 * 1024
# Output budget assumed when the client sets none (vLLM's own default is "the
# rest of the context", unknown here; 256 is a typical chat answer).
DEFAULT_MAX_TOKENS = 256
# Token counts go into int64 numpy arrays downstream: keep them far from overflow.
MAX_TOKENS_LIMIT = 2**31 - 1
# Deepest array/object nesting accepted. orjson 3.8 parses recursively with no
# limit and crashes the process (SIGSEGV) somewhere past ~70k levels, i.e. on a
# ~150 KB body; newer orjson stops at 1024. We check before parsing.
MAX_NESTING = 512
# Characters one token id stands for in the prompt text (4 chars ≈ 1 token).
_TOKEN_ID_CHARS = 4

_JSON_TYPE_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
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


class _PromptText:
    """Accumulates prompt pieces up to a character cap while counting all of them.

    Pieces past the cap are counted (for the token estimate) but not copied, so
    a 100 MB prompt costs a length lookup, not a 100 MB join.
    """

    __slots__ = ("chars", "parts", "room")

    def __init__(self, cap: int) -> None:
        self.parts: list[str] = []
        self.chars = 0
        self.room = cap

    def add(self, piece: str) -> None:
        n = len(piece)
        self.chars += n
        room = self.room
        if room <= 0 or n == 0:
            return
        if n > room:
            piece = piece[:room]
            n = room
        self.parts.append(piece)
        self.room = room - n

    def add_token_ids(self, ids: list[int]) -> None:
        """Token ids as 4 characters each (last 4 digits, zero-padded), so a
        block of 64 characters is 16 tokens, like text (same as the simulator)."""
        keep = max(0, min(len(ids), self.room // _TOKEN_ID_CHARS + 1))
        self.add("".join([f"{p:04d}"[-_TOKEN_ID_CHARS:] for p in ids[:keep]]))
        self.chars += (len(ids) - keep) * _TOKEN_ID_CHARS

    def text(self) -> str:
        return "".join(self.parts)


# ---------------------------------------------------------------- transport checks


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


def _check_content_headers(content_type: str | None, content_encoding: str | None) -> None:
    """Refuse compressed or non-JSON bodies before spending a parse on them.

    A missing content type is accepted (curl users forget it; the body decides).
    """
    if content_encoding:
        coding = content_encoding.strip().lower()
        if coding and coding != "identity":
            raise UnsupportedContentEncoding(
                f"Content-Encoding `{echo(coding, 40)}` is not supported: the gateway reads "
                "the model from the body and does not decompress it. Send the body "
                "uncompressed (Content-Encoding: identity)."
            )
    if content_type:
        media = content_type.partition(";")[0].strip().lower()
        if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")
        ):
            raise UnsupportedMediaType(
                f"Content-Type `{echo(media, 80)}` is not supported: send the body as "
                "application/json."
            )


def _check_size(body: bytes | bytearray | memoryview, limit: int) -> int:
    size = body.nbytes if isinstance(body, memoryview) else len(body)
    if size > limit:
        raise BodyTooLarge(f"Request body is {size} bytes; the limit is {limit} bytes.")
    if size == 0:
        raise InvalidRequest("Request body is empty; expected a JSON object.")
    return size


# ---------------------------------------------------------------- nesting guard


def _escaped(quotes: np.ndarray, backslashes: np.ndarray) -> np.ndarray:
    """Which quote positions are escaped: preceded by an odd run of backslashes."""
    breaks = np.flatnonzero(np.diff(backslashes) != 1)
    ends = np.append(backslashes[breaks], backslashes[-1])
    starts = np.insert(backslashes[breaks + 1], 0, backslashes[0])
    before = quotes - 1
    i = np.minimum(np.searchsorted(ends, before), ends.size - 1)
    # run length ends - starts + 1 is odd exactly when ends - starts is even
    return (ends[i] == before) & (((ends[i] - starts[i]) & 1) == 0)


def max_nesting_depth(body: bytes | bytearray | memoryview) -> int:
    """Deepest array/object nesting of a JSON text, in vectorized numpy passes.

    Brackets inside strings are ignored (string extent = unescaped quotes). Exact
    for valid JSON; for invalid JSON it is exact up to the first syntax error,
    which is as far as any parser gets, so it still bounds the parser's depth.
    """
    a = np.frombuffer(body, dtype=np.uint8)
    quotes = np.flatnonzero(a == 0x22)
    if quotes.size:
        backslashes = np.flatnonzero(a == 0x5C)
        if backslashes.size:
            quotes = quotes[~_escaped(quotes, backslashes)]
    folded = a | 0x20  # '[' -> '{' and ']' -> '}'; no other byte folds onto them
    is_open = folded == 0x7B
    pos = np.flatnonzero(is_open | (folded == 0x7D))
    if quotes.size and pos.size:
        pos = pos[(np.searchsorted(quotes, pos) & 1) == 0]
    if not pos.size:
        return 0
    steps = np.where(is_open[pos], 1, -1)
    return max(0, int(np.cumsum(steps).max()))


def _check_nesting(body: bytes | bytearray | memoryview) -> None:
    """Refuse bodies nested deeper than MAX_NESTING before orjson recurses into them.

    Fast path: the number of opening brackets bounds the depth, and `bytes.count`
    runs at memchr speed; only bodies with many brackets pay the exact scan.
    """
    if isinstance(body, bytes | bytearray) and body.count(b"[") + body.count(b"{") <= MAX_NESTING:
        return
    if max_nesting_depth(body) > MAX_NESTING:
        raise InvalidRequest(
            f"The request body is nested more than {MAX_NESTING} levels deep; not accepted."
        )


def _loads(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """orjson.loads, with every failure mapped to a 400 that says why."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # invalid JSON or UTF-8, NaN, 1e400, ...
        raise InvalidRequest(f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:  # defensive: other orjson versions / builds
        raise InvalidRequest("The request body is nested too deeply.") from None
    if type(data) is not dict:
        raise InvalidRequest(f"The request body must be a JSON object, not {_kind(data)}.")
    return data


def _kind(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- common fields


def _model(data: dict[str, Any]) -> str:
    model = data.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model")
    if type(model) is not str:
        raise InvalidRequest(f"`model` must be a string, not {_kind(model)}.", param="model")
    if not model:
        raise InvalidRequest("`model` must not be empty.", param="model")
    return model


def _stream(data: dict[str, Any]) -> bool:
    stream = data.get("stream")
    if stream is None:  # absent or null: OpenAI's optional params are nullable
        return False
    if type(stream) is not bool:
        raise InvalidRequest(f"`stream` must be a boolean, not {_kind(stream)}.", param="stream")
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
    return f"{value}" if type(value) is int else _kind(value)


def _max_tokens(data: dict[str, Any], *keys: str) -> int:
    """First of `keys` the client set (all are validated), else DEFAULT_MAX_TOKENS."""
    chosen: int | None = None
    for key in keys:
        value = _token_limit(data, key)
        if chosen is None:
            chosen = value
    return DEFAULT_MAX_TOKENS if chosen is None else chosen


# ---------------------------------------------------------------- prompt text


def _content(content: Any, text: _PromptText, param: str) -> None:
    """A message's content: a string, null, or a list of parts whose `text` counts."""
    if content is None:
        return
    if type(content) is str:
        text.add(content)
        return
    if type(content) is not list:
        raise InvalidRequest(
            f"`{param}` must be a string or an array of content parts, not {_kind(content)}.",
            param=param,
        )
    for j, part in enumerate(content):
        if type(part) is not dict:
            raise InvalidRequest(f"`{param}[{j}]` must be an object.", param=f"{param}[{j}]")
        piece = part.get("text")
        if piece is None:  # image, audio, file parts: no text to hash
            continue
        if type(piece) is not str:
            raise InvalidRequest(
                f"`{param}[{j}].text` must be a string.", param=f"{param}[{j}].text"
            )
        text.add(piece)


def _message(message: Any, text: _PromptText, param: str) -> None:
    """One chat message as `<|role|>\\n` + content + `\\n` (a chat template's shape)."""
    if type(message) is not dict:
        raise InvalidRequest(f"`{param}` must be an object, not {_kind(message)}.", param=param)
    role = message.get("role")
    if type(role) is not str:
        raise InvalidRequest(f"`{param}.role` must be a string.", param=f"{param}.role")
    text.add(f"<|{role}|>\n")
    _content(message.get("content"), text, f"{param}.content")
    text.add("\n")


def _chat_text(messages: Any, text: _PromptText, generation_prompt: bool) -> None:
    if type(messages) is not list or not messages:
        raise InvalidRequest("`messages` must be a non-empty array of objects.", param="messages")
    for i, message in enumerate(messages):
        _message(message, text, f"messages[{i}]")
    if generation_prompt:
        text.add("<|assistant|>\n")


def _prompt_value(value: Any, text: _PromptText, param: str) -> None:
    """A completions `prompt` / embeddings `input`: a string, or an array of
    strings, of token ids, or of token-id arrays."""
    if type(value) is str:
        text.add(value)
        return
    if type(value) is not list:
        raise InvalidRequest(
            f"`{param}` must be a string or an array, not {_kind(value)}.", param=param
        )
    if not value:
        return
    kinds = set(map(type, value))
    if kinds == {str}:
        for piece in value:
            text.add(piece)
    elif kinds == {int}:
        text.add_token_ids(value)
    elif kinds == {list}:
        for i, ids in enumerate(value):
            if ids and set(map(type, ids)) != {int}:
                raise InvalidRequest(
                    f"`{param}[{i}]` must be an array of token ids (integers).",
                    param=f"{param}[{i}]",
                )
            text.add_token_ids(ids)
    else:
        raise InvalidRequest(
            f"`{param}` must be an array of strings, of token ids, or of token-id arrays.",
            param=param,
        )


def _chat(data: dict[str, Any], text: _PromptText) -> int:
    _chat_text(data.get("messages"), text, generation_prompt=True)
    return _max_tokens(data, "max_completion_tokens", "max_tokens")


def _completions(data: dict[str, Any], text: _PromptText) -> int:
    prompt = data.get("prompt")
    if prompt is None and data.get("prompt_embeds") is None:
        raise InvalidRequest("You must provide a `prompt`.", param="prompt")
    if prompt is not None:
        _prompt_value(prompt, text, "prompt")
    return _max_tokens(data, "max_tokens")


def _embeddings(data: dict[str, Any], text: _PromptText) -> int:
    value = data.get("input")
    if value is not None:
        _prompt_value(value, text, "input")
    elif data.get("messages") is not None:  # vLLM's chat-style embeddings request
        _chat_text(data["messages"], text, generation_prompt=False)
    else:
        raise InvalidRequest("You must provide an `input`.", param="input")
    return 0  # an embedding generates no tokens


def _responses(data: dict[str, Any], text: _PromptText) -> int:
    instructions = data.get("instructions")
    if instructions is not None:
        if type(instructions) is not str:
            raise InvalidRequest("`instructions` must be a string.", param="instructions")
        text.add("<|system|>\n")
        text.add(instructions)
        text.add("\n")
    value = data.get("input")
    if value is None:
        raise InvalidRequest("You must provide an `input`.", param="input")
    if type(value) is str:
        text.add("<|user|>\n")
        text.add(value)
        text.add("\n")
    elif type(value) is list:
        for i, item in enumerate(value):
            _response_item(item, text, f"input[{i}]")
    else:
        raise InvalidRequest(
            f"`input` must be a string or an array of items, not {_kind(value)}.", param="input"
        )
    text.add("<|assistant|>\n")
    return _max_tokens(data, "max_output_tokens")


def _response_item(item: Any, text: _PromptText, param: str) -> None:
    """A Responses API input item: messages count like chat; other items
    (function calls, reasoning, references) carry no prompt text we hash."""
    if type(item) is not dict:
        raise InvalidRequest(f"`{param}` must be an object, not {_kind(item)}.", param=param)
    if "role" in item:
        _message(item, text, param)


_API_PARSERS = {
    "chat": _chat,
    "completions": _completions,
    "embeddings": _embeddings,
    "responses": _responses,
}


# ---------------------------------------------------------------- entry point


def parse_request(
    body: bytes | bytearray | memoryview,
    path: str,
    content_type: str | None,
    content_encoding: str | None,
    limit: int,
) -> InferenceRequest:
    """Parse one request body (once) into an InferenceRequest, or raise an ApiError.

    Order: path (404), size (413), content headers (415), empty body (400),
    nesting guard, JSON parse, then the fields of the API the path names (400).
    """
    api = _api_for_path(path)
    _check_size(body, limit)
    _check_content_headers(content_type, content_encoding)
    _check_nesting(body)
    data = _loads(body)
    model = _model(data)
    stream = _stream(data)
    text = _PromptText(PROMPT_CHAR_CAP)
    max_tokens = _API_PARSERS[api](data, text)
    return InferenceRequest(
        model=model,
        api=api,
        stream=stream,
        prompt=text.text(),
        prompt_tokens=(text.chars + 3) // 4,
        max_tokens=max_tokens,
        adapter=None,
        base_model=model,
        body=data,
    )
