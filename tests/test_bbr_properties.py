"""Property tests: parse_request never lets anything but an ApiError escape.

Whatever a client sends (random bytes, any JSON value in any field, invalid
UTF-8, absurd nesting or numbers, duplicate keys), the answer is either an
InferenceRequest or an ApiError the handler turns into a 4xx.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bbr.json_body import MAX_NESTING, max_nesting_depth
from bbr.prompt import PROMPT_CHAR_CAP
from bbr.request import API_PATHS, InferenceRequest, parse_request
from contract.errors import ApiError

PATHS = [*API_PATHS, "/v1/other"]
FIELDS = [
    "model", "messages", "prompt", "input", "stream", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "instructions", "prompt_embeds",
]  # fmt: skip
LIMIT = 1 << 22

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
KEYS = st.sampled_from([*FIELDS, "role", "content", "text", "x"])
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=20,
)


def attempt(raw: bytes | memoryview, path: str = "/v1/chat/completions", **kw: Any) -> None:
    try:
        result = parse_request(raw, path, kw.get("ct", "application/json"), kw.get("ce"), LIMIT)
    except ApiError as exc:
        assert 400 <= exc.status < 500
        return
    assert isinstance(result, InferenceRequest)
    assert isinstance(result.model, str) and result.model
    assert result.api in API_PATHS.values()
    assert isinstance(result.stream, bool)
    assert len(result.prompt) <= PROMPT_CHAR_CAP
    assert result.prompt_tokens >= 0 and result.max_tokens >= 0


def deep(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=400), path=st.sampled_from(PATHS))
@example(raw=b"", path="/v1/chat/completions")
@example(raw=b"\xff\xfe\xfd", path="/v1/chat/completions")
@example(raw=b'{"model": "\xc3\x28"}', path="/v1/chat/completions")
@example(raw=deep(10_000), path="/v1/chat/completions")
@example(raw=deep(10_000, b'{"a":', b"}"), path="/v1/completions")
@example(raw=b'{"model":"m","x":1e400}', path="/v1/embeddings")
@example(raw=b'{"model":"m","x":' + b"9" * 5000 + b"}", path="/v1/embeddings")
@example(raw=b'{"model":1,"model":"m","input":"a","input":2}', path="/v1/embeddings")
def test_arbitrary_bytes(raw: bytes, path: str) -> None:
    attempt(raw, path)
    attempt(memoryview(raw), path)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values, path=st.sampled_from(PATHS))
def test_arbitrary_json_values(value: Any, path: str) -> None:
    attempt(orjson.dumps(value), path)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    overrides=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4),
    path=st.sampled_from(PATHS),
)
def test_valid_body_with_any_field_replaced(overrides: dict[str, Any], path: str) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "prompt": "p",
        "input": "i",
        **overrides,
    }
    attempt(orjson.dumps(body), path)


@settings(max_examples=200)
@given(
    model=st.text(min_size=1, max_size=20),
    contents=st.lists(st.text(max_size=50), min_size=1, max_size=5),
    stream=st.booleans(),
    max_tokens=st.none() | st.integers(min_value=0, max_value=2**31 - 1),
)
def test_valid_chat_always_parses(
    model: str, contents: list[str], stream: bool, max_tokens: int | None
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": c} for c in contents],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    req = parse_request(orjson.dumps(body), "/v1/chat/completions", None, None, LIMIT)
    assert req.model == model and req.stream is stream
    assert req.prompt == "".join(f"<|user|>\n{c}\n" for c in contents) + "<|assistant|>\n"
    assert req.prompt_tokens == -(-len(req.prompt) // 4)


@settings(max_examples=200)
@given(raw=st.binary(min_size=1, max_size=200), cut=st.integers(min_value=0, max_value=200))
def test_corrupted_valid_body(raw: bytes, cut: int) -> None:
    """Valid JSON with random bytes spliced in (invalid UTF-8, broken tokens)."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello world"}]})
    cut = min(cut, len(body))
    attempt(body[:cut] + raw + body[cut:])


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(min_value=1, max_value=3 * MAX_NESTING),
    kinds=st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"b":', b"}]")]),
    terminated=st.booleans(),
)
def test_nesting_any_depth(depth: int, kinds: tuple[bytes, bytes], terminated: bool) -> None:
    open_, close = kinds
    inner = open_ * depth + (b"1" + close * depth if terminated else b"")
    attempt(b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + inner + b"}")


def reference_depth(value: Any) -> int:
    """Nesting depth of a Python value, counted like max_nesting_depth counts text."""
    stack = [(value, 1)]
    best = 0
    while stack:
        node, level = stack.pop()
        if isinstance(node, list | dict):
            best = max(best, level)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return best


tricky_text = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=12)
tricky_values = st.recursive(
    st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | tricky_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(tricky_text, children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=400)
@given(value=tricky_values, ensure_ascii=st.booleans())
def test_max_nesting_depth_matches_structure(value: Any, ensure_ascii: bool) -> None:
    """Exact on valid JSON, whatever brackets, quotes and backslashes the strings hold."""
    for raw in (orjson.dumps(value), json.dumps(value, ensure_ascii=ensure_ascii).encode()):
        assert max_nesting_depth(raw) == reference_depth(value)
