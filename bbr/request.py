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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from contract.errors import (
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
# Below this size `bytes.count` beats numpy's per-call overhead.
_SMALL_BODY = 8192
# Slice size for vectorized scans (see _chunks).
_CHUNK = 64 * 1024
# Characters one token id stands for in the prompt text (4 chars ≈ 1 token).
_TOKEN_ID_CHARS = 4

_ROLE_HEADS = {r: f"<|{r}|>\n" for r in ("system", "developer", "user", "assistant", "tool")}
_ASSISTANT_HEAD = _ROLE_HEADS["assistant"]

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
    """Prompt pieces in order, joined once at the end up to a character cap.

    The hot loop only appends references to strings orjson already built (no
    copies, no per-piece bookkeeping); `finish` counts every character for the
    token estimate but copies at most `cap` of them, so a 100 MB prompt costs a
    length sum, not a 100 MB join.
    """

    __slots__ = ("_counted", "_counted_chars", "append", "cap", "extra", "parts")

    def __init__(self, cap: int) -> None:
        self.parts: list[str] = []
        self.append = self.parts.append
        self.cap = cap
        self.extra = 0  # characters counted but never rendered (token ids past the cap)
        self._counted = 0  # parts[:_counted] hold _counted_chars characters
        self._counted_chars = 0

    def _used(self) -> int:
        """Characters appended so far, summing only the parts added since last time
        (a batch of many token-id arrays stays linear)."""
        if self._counted < len(self.parts):
            self._counted_chars += sum(map(len, self.parts[self._counted :]))
            self._counted = len(self.parts)
        return self._counted_chars

    def add_token_ids(self, ids: list[int]) -> None:
        """Token ids as 4 characters each (last 4 digits, zero-padded), so a
        block of 64 characters is 16 tokens, like text (same as the simulator).
        Only the ids that can still fit under the cap are rendered."""
        room = self.cap - self._used()
        if room <= 0:
            self.extra += len(ids) * _TOKEN_ID_CHARS
            return
        keep = min(len(ids), room // _TOKEN_ID_CHARS + 1)
        self.append("".join([f"{p:04d}"[-_TOKEN_ID_CHARS:] for p in ids[:keep]]))
        self.extra += (len(ids) - keep) * _TOKEN_ID_CHARS

    def finish(self) -> tuple[str, int]:
        """(text capped at `cap` characters, total characters of the whole prompt)."""
        parts = self.parts
        chars = sum(map(len, parts))
        if chars <= self.cap:
            return "".join(parts), chars + self.extra
        kept: list[str] = []
        room = self.cap
        for piece in parts:
            if len(piece) >= room:
                kept.append(piece[:room])
                break
            kept.append(piece)
            room -= len(piece)
        return "".join(kept), chars + self.extra


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


def _chunks(body: bytes | bytearray | memoryview) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, uint8 view) slices of the body, `_CHUNK` bytes each.

    Whole-body temporaries of a few hundred KB land above glibc's mmap threshold
    and are page-faulted in on every call (measured: 8x slower at 256 KB);
    small chunks keep every temporary in the reused heap.
    """
    a = np.frombuffer(body, dtype=np.uint8)
    for offset in range(0, a.size, _CHUNK):
        yield offset, a[offset : offset + _CHUNK]


def max_nesting_depth(body: bytes | bytearray | memoryview) -> int:
    """Deepest array/object nesting of a JSON text, in vectorized numpy passes.

    Brackets inside strings are ignored (string extent = unescaped quotes). Exact
    for valid JSON; for invalid JSON it is exact up to the first syntax error,
    which is as far as any parser gets, so it still bounds the parser's depth.
    """
    quotes, slashes, opens, closes = [], [], [], []
    for offset, chunk in _chunks(body):
        quotes.append(np.flatnonzero(chunk == 0x22) + offset)
        slashes.append(np.flatnonzero(chunk == 0x5C) + offset)
        folded = chunk | 0x20  # '[' -> '{' and ']' -> '}'; no other byte folds onto them
        opens.append(np.flatnonzero(folded == 0x7B) + offset)
        closes.append(np.flatnonzero(folded == 0x7D) + offset)
    if not opens:
        return 0
    q, o, c = np.concatenate(quotes), np.concatenate(opens), np.concatenate(closes)
    bs = np.concatenate(slashes)
    if q.size and bs.size:
        q = q[~_escaped(q, bs)]
    if q.size:  # keep brackets outside strings: an even number of quotes before them
        o = o[(np.searchsorted(q, o) & 1) == 0]
        c = c[(np.searchsorted(q, c) & 1) == 0]
    if not o.size:
        return 0
    # depth just after the j-th opening bracket = (j + 1) - closings before it
    return max(0, int((np.arange(1, o.size + 1) - np.searchsorted(c, o)).max()))


def _opening_brackets(body: bytes | bytearray | memoryview) -> int:
    """How many `[` and `{` bytes the body holds (inside strings too): a depth bound.

    `bytes.count` is cheapest on small bodies; numpy's vectorized compare is ~5x
    faster than it on large ones.
    """
    if len(body) <= _SMALL_BODY and isinstance(body, bytes | bytearray):
        return body.count(b"[") + body.count(b"{")
    return sum(int(np.count_nonzero((c | 0x20) == 0x7B)) for _, c in _chunks(body))


def _check_nesting(body: bytes | bytearray | memoryview) -> None:
    """Refuse bodies nested deeper than MAX_NESTING before orjson recurses into them.

    Fast path: the number of opening brackets bounds the depth; only bodies with
    more than MAX_NESTING of them pay for the exact, string-aware scan.
    """
    if _opening_brackets(body) <= MAX_NESTING:
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


def _index(items: list[Any], item: Any) -> int:
    """Position of `item` in `items` by identity: error paths only, so the hot
    loops need no enumerate()."""
    return next(i for i, x in enumerate(items) if x is item)


def _content_parts(content: Any, append: Callable[[str], None], where: Callable[[], str]) -> None:
    """A non-string, non-null message content: a list of parts whose `text` counts.

    `where()` names the content field; it is called only to build an error (the
    message's index is found by a linear search, which must stay off the hot path).
    """
    if type(content) is not list:
        param = where()
        raise InvalidRequest(
            f"`{param}` must be a string or an array of content parts, not {_kind(content)}.",
            param=param,
        )
    for part in content:
        if type(part) is not dict:
            param = f"{where()}[{_index(content, part)}]"
            raise InvalidRequest(f"`{param}` must be an object.", param=param)
        piece = part.get("text")
        if piece is None:  # image, audio, file parts: no text to hash
            continue
        if type(piece) is not str:
            param = f"{where()}[{_index(content, part)}].text"
            raise InvalidRequest(f"`{param}` must be a string.", param=param)
        append(piece)


def _messages(messages: list[Any], text: _PromptText, name: str) -> None:
    """Messages as `<|role|>\\n` + content + `\\n` each (a chat template's shape).

    Items without a `role` are skipped when `name` is "input" (Responses API
    items such as function calls carry no prompt text); in chat they are a 400.
    """
    append = text.append
    heads = _ROLE_HEADS
    for message in messages:
        if type(message) is not dict:
            where = f"{name}[{_index(messages, message)}]"
            raise InvalidRequest(f"`{where}` must be an object, not {_kind(message)}.", param=where)
        role = message.get("role")
        if type(role) is not str:
            if role is None and name == "input":
                continue
            where = f"{name}[{_index(messages, message)}].role"
            raise InvalidRequest(f"`{where}` must be a string.", param=where)
        append(heads.get(role) or f"<|{role}|>\n")
        content = message.get("content")
        if type(content) is str:
            append(content)
        elif content is not None:
            _content_parts(
                content,
                append,
                lambda m=message: f"{name}[{_index(messages, m)}].content",
            )
        append("\n")


def _chat_text(messages: Any, text: _PromptText, generation_prompt: bool) -> None:
    if type(messages) is not list or not messages:
        raise InvalidRequest("`messages` must be a non-empty array of objects.", param="messages")
    _messages(messages, text, "messages")
    if generation_prompt:
        text.append(_ASSISTANT_HEAD)


def _prompt_value(value: Any, text: _PromptText, param: str) -> None:
    """A completions `prompt` / embeddings `input`: a string, or an array of
    strings, of token ids, or of token-id arrays."""
    if type(value) is str:
        text.append(value)
        return
    if type(value) is not list:
        raise InvalidRequest(
            f"`{param}` must be a string or an array, not {_kind(value)}.", param=param
        )
    if not value:
        return
    kinds = set(map(type, value))
    if kinds == {str}:
        text.parts.extend(value)
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
        text.parts.extend((_ROLE_HEADS["system"], instructions, "\n"))
    value = data.get("input")
    if value is None:
        raise InvalidRequest("You must provide an `input`.", param="input")
    if type(value) is str:
        text.parts.extend((_ROLE_HEADS["user"], value, "\n"))
    elif type(value) is list:
        _messages(value, text, "input")
    else:
        raise InvalidRequest(
            f"`input` must be a string or an array of items, not {_kind(value)}.", param="input"
        )
    text.append(_ASSISTANT_HEAD)
    return _max_tokens(data, "max_output_tokens")


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

    Order: path (404), size (413) and empty body (400), content headers (415),
    nesting guard (400), JSON parse (400), then the fields of the API the path
    names (400).
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
    prompt, chars = text.finish()
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
