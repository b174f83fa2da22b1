"""The JSON guard: request body bytes → one validated JSON object, or a 400/413/415.

`read_object` runs once per request on the picker's hot path, cheapest check
first: size (413) and empty body (400), content headers (415), nesting depth
(400), then one orjson parse (400 for anything orjson refuses or a top level
that is not an object). What the object holds is the caller's business
(bbr.request, bbr.prompt).

Why the hand-written nesting guard stays although orjson ≥ 3.9.15 limits depth
itself (measured with orjson 3.13.0):

- orjson accepts up to 1024 levels and refuses the 1025th; the gateway's limit
  is `MAX_NESTING` = 512. Leaning on orjson would accept bodies nested 513 to
  1024 deep that are a 400 today (tests/test_bbr_request.py pins 512).
- orjson's message names no nesting ("depth limit exceeded: line 1 column
  1026", earlier releases "array and object recursion depth exceeded"), and an
  unterminated `[[[[…` shorter than its limit reads "failed to allocate
  memory"; the guard says "nested more than 512 levels deep" for both.

orjson's own limit is still what keeps the unguarded `orjson.loads` calls
(the simulated pods parse bodies sent straight to them) from overflowing the
stack, hence the dependency floor 3.9.15.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson

from contract.errors import (
    BodyTooLarge,
    InvalidRequest,
    UnsupportedContentEncoding,
    UnsupportedMediaType,
    echo,
)

__all__ = ["MAX_NESTING", "kind", "max_nesting_depth", "read_object"]

# Deepest array/object nesting accepted. orjson 3.8 parses recursively with no
# limit and crashes the process (SIGSEGV) somewhere past ~70k levels, i.e. on a
# ~150 KB body; orjson ≥ 3.9.15 stops at 1024. We check before parsing.
MAX_NESTING = 512
# Below this size `bytes.count` beats numpy's per-call overhead.
_SMALL_BODY = 8192
# Slice size for vectorized scans (see _chunks).
_CHUNK = 64 * 1024

_JSON_TYPE_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def kind(value: object) -> str:
    """A parsed JSON value's type as an error message names it ("an array", "null")."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- transport checks


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


# ---------------------------------------------------------------- parse


def _loads(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """orjson.loads, with every failure mapped to a 400 that says why."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # invalid JSON or UTF-8, NaN, 1e400, ...
        raise InvalidRequest(f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:  # defensive: other orjson versions / builds
        raise InvalidRequest("The request body is nested too deeply.") from None
    if type(data) is not dict:
        raise InvalidRequest(f"The request body must be a JSON object, not {kind(data)}.")
    return data


def read_object(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    content_encoding: str | None,
    limit: int,
) -> dict[str, Any]:
    """The body as a JSON object, or an ApiError: size and empty body (413/400),
    content headers (415), nesting guard (400), JSON parse and top-level type (400)."""
    _check_size(body, limit)
    _check_content_headers(content_type, content_encoding)
    _check_nesting(body)
    return _loads(body)
