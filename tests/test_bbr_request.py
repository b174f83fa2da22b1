"""bbr.request.parse_request: every API shape and every 400/404/413/415 path."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from bbr.json_body import MAX_NESTING, max_nesting_depth
from bbr.prompt import PROMPT_CHAR_CAP
from bbr.request import (
    DEFAULT_MAX_TOKENS,
    MAX_TOKENS_LIMIT,
    InferenceRequest,
    parse_request,
)
from contract.errors import (
    ApiError,
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    UnsupportedContentEncoding,
    UnsupportedMediaType,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
LIMIT = 1 << 20
JSON = "application/json"


def parse(
    body: Any,
    path: str = CHAT,
    content_type: str | None = JSON,
    content_encoding: str | None = None,
    limit: int = LIMIT,
) -> InferenceRequest:
    raw = body if isinstance(body, bytes | bytearray | memoryview) else orjson.dumps(body)
    return parse_request(raw, path, content_type, content_encoding, limit)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def rejects(exc_type: type[ApiError], body: Any, **kw: Any) -> ApiError:
    with pytest.raises(exc_type) as info:
        parse(body, **kw)
    return info.value


# ------------------------------------------------------------------ happy paths


def test_chat_basic() -> None:
    req = parse(chat(stream=True))
    assert req.model == "m" and req.base_model == "m" and req.adapter is None
    assert req.api == "chat"
    assert req.stream is True
    assert req.prompt == "<|user|>\nhi\n<|assistant|>\n"
    assert req.prompt_tokens == -(-len(req.prompt) // 4)
    assert req.max_tokens == DEFAULT_MAX_TOKENS
    assert req.body["messages"][0]["content"] == "hi"


def test_chat_roles_in_order_and_content_parts() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at "},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "this"},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "42", "tool_call_id": "1"},
        ],
    }
    req = parse(body)
    assert req.prompt == (
        "<|system|>\nbe brief\n<|user|>\nlook at this\n<|assistant|>\n\n"
        "<|tool|>\n42\n<|assistant|>\n"
    )


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse(chat(max_tokens=10)).max_tokens == 10
    assert parse(chat(max_completion_tokens=20, max_tokens=10)).max_tokens == 20
    assert parse(chat(max_tokens=0)).max_tokens == 0
    assert parse(chat(max_tokens=None)).max_tokens == DEFAULT_MAX_TOKENS


def test_nullable_optionals() -> None:
    req = parse(chat(stream=None, max_tokens=None, max_completion_tokens=None))
    assert req.stream is False and req.max_tokens == DEFAULT_MAX_TOKENS


def test_completions_shapes() -> None:
    req = parse({"model": "m", "prompt": "abc", "max_tokens": 5}, COMPLETIONS)
    assert (req.api, req.prompt, req.max_tokens, req.prompt_tokens) == ("completions", "abc", 5, 1)
    assert parse({"model": "m", "prompt": ["ab", "cd"]}, COMPLETIONS).prompt == "abcd"
    tokens = parse({"model": "m", "prompt": [1, 22, 12345]}, COMPLETIONS)
    assert tokens.prompt == "000100222345" and tokens.prompt_tokens == 3
    batch = parse({"model": "m", "prompt": [[1, 2], [3]]}, COMPLETIONS)
    assert batch.prompt == "000100020003" and batch.prompt_tokens == 3
    assert parse({"model": "m", "prompt": []}, COMPLETIONS).prompt == ""
    assert parse({"model": "m", "prompt_embeds": "base64"}, COMPLETIONS).prompt == ""


def test_embeddings_shapes() -> None:
    req = parse({"model": "e", "input": "hello"}, EMBEDDINGS)
    assert (req.api, req.prompt, req.max_tokens, req.stream) == ("embeddings", "hello", 0, False)
    assert parse({"model": "e", "input": ["a", "b"]}, EMBEDDINGS).prompt == "ab"
    assert parse({"model": "e", "input": [7, 8]}, EMBEDDINGS).prompt_tokens == 2
    msgs = parse({"model": "e", "messages": [{"role": "user", "content": "q"}]}, EMBEDDINGS)
    assert msgs.prompt == "<|user|>\nq\n"


def test_responses_shapes() -> None:
    req = parse(
        {"model": "r", "input": "hello", "instructions": "sys", "max_output_tokens": 9},
        RESPONSES,
    )
    assert req.api == "responses"
    assert req.prompt == "<|system|>\nsys\n<|user|>\nhello\n<|assistant|>\n"
    assert req.max_tokens == 9
    items = parse(
        {
            "model": "r",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
                {"type": "message", "role": "assistant", "content": "b"},
            ],
        },
        RESPONSES,
    )
    assert items.prompt == "<|user|>\na\n<|assistant|>\nb\n<|assistant|>\n"
    assert items.max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    "path", [CHAT + "?x=1", CHAT + "/", "/v1/chat/completions?stream=true&a=/b"]
)
def test_path_query_and_trailing_slash(path: str) -> None:
    assert parse(chat(), path).api == "chat"


@pytest.mark.parametrize(
    "content_type",
    [None, "", "application/json", "application/json; charset=utf-8", "Application/JSON",
     "application/vnd.api+json"],
)  # fmt: skip
def test_accepted_content_types(content_type: str | None) -> None:
    assert parse(chat(), content_type=content_type).model == "m"


@pytest.mark.parametrize("encoding", [None, "", "identity", " Identity "])
def test_accepted_content_encodings(encoding: str | None) -> None:
    assert parse(chat(), content_encoding=encoding).model == "m"


def test_body_types_bytes_bytearray_memoryview() -> None:
    raw = orjson.dumps(chat())
    for body in (raw, bytearray(raw), memoryview(raw)):
        assert parse_request(body, CHAT, JSON, None, LIMIT).model == "m"


def test_duplicate_keys_last_wins() -> None:
    req = parse(b'{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}')
    assert req.model == "b"


def test_prompt_cap_keeps_token_estimate_of_whole_prompt() -> None:
    big = "x" * (PROMPT_CHAR_CAP * 2)
    req = parse({"model": "m", "prompt": big}, COMPLETIONS, limit=len(big) + 100)
    assert len(req.prompt) == PROMPT_CHAR_CAP
    assert req.prompt_tokens == len(big) // 4
    many = parse({"model": "m", "prompt": [1] * (PROMPT_CHAR_CAP // 2)}, COMPLETIONS, limit=1 << 24)
    assert len(many.prompt) == PROMPT_CHAR_CAP and many.prompt_tokens == PROMPT_CHAR_CAP // 2


def test_chat_prompt_cap_across_messages() -> None:
    part = "y" * (PROMPT_CHAR_CAP // 3)
    msgs = [{"role": "user", "content": part} for _ in range(6)]
    req = parse({"model": "m", "messages": msgs}, limit=1 << 24)
    assert len(req.prompt) == PROMPT_CHAR_CAP
    assert req.prompt_tokens > PROMPT_CHAR_CAP // 2


def test_moderate_nesting_in_other_fields_is_fine() -> None:
    deep: Any = "leaf"
    for _ in range(100):
        deep = {"a": [deep]}
    assert parse(chat(tools=[deep])).model == "m"


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = "[" * (MAX_NESTING * 4) + '\\"{{{{' + "{" * 2000
    req = parse(chat(messages=[{"role": "user", "content": text}]))
    assert text in req.prompt


# ------------------------------------------------------------------ transport errors


@pytest.mark.parametrize("path", ["/v1/foo", "/v1/models", "/", "", "/v1/chat/completion"])
def test_unknown_path_is_404(path: str) -> None:
    exc = rejects(NotFound, chat(), path=path)
    assert exc.status == 404


def test_body_too_large_is_413() -> None:
    raw = orjson.dumps(chat())
    exc = rejects(BodyTooLarge, raw, limit=len(raw) - 1)
    assert exc.status == 413 and str(len(raw)) in exc.message
    assert parse(raw, limit=len(raw)).model == "m"


def test_body_too_large_memoryview() -> None:
    raw = memoryview(orjson.dumps(chat()))
    rejects(BodyTooLarge, raw, limit=10)


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate", "zstd", "gzip, br", "GZIP"])
def test_compressed_body_is_415(encoding: str) -> None:
    exc = rejects(UnsupportedContentEncoding, chat(), content_encoding=encoding)
    assert exc.status == 415
    assert "decompress" in exc.message


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/xml", "jsonish"],
)  # fmt: skip
def test_non_json_content_type_is_415(content_type: str) -> None:
    exc = rejects(UnsupportedMediaType, chat(), content_type=content_type)
    assert exc.status == 415


# ------------------------------------------------------------------ body errors (400)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "empty"),
        (b"   ", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"not json", "not valid JSON"),
        (b'{"model": "m",}', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b'{"model": "\xed\xa0\x80"}', "not valid JSON"),  # encoded surrogate
        (b'{"model": "\\ud800"}', "not valid JSON"),  # lone escaped surrogate
        (b'{"model": "m", "x": NaN}', "not valid JSON"),
        (b'{"model": "m", "x": 1e400}', "not valid JSON"),
        (b'{"model": "m", "x": -1e400}', "not valid JSON"),
        (b"[]", "must be a JSON object, not an array"),
        (b'"model"', "not a string"),
        (b"null", "not null"),
        (b"42", "not an integer"),
    ],
)
def test_not_a_json_object(raw: bytes, fragment: str) -> None:
    exc = rejects(InvalidRequest, raw)
    assert fragment in exc.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        (chat(model=None), "model"),
        (chat(model=""), "model"),
        (chat(model=7), "model"),
        (chat(model=["m"]), "model"),
        (chat(model={"id": "m"}), "model"),
        (chat(model=True), "model"),
    ],
)
def test_model_missing_or_wrong(body: dict[str, Any], param: str) -> None:
    assert rejects(InvalidRequest, body).param == param


@pytest.mark.parametrize("stream", [1, 0, "true", "false", [], {}, 1.0])
def test_stream_must_be_boolean(stream: Any) -> None:
    assert rejects(InvalidRequest, chat(stream=stream)).param == "stream"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, 10.0, "10", True, [], {}, MAX_TOKENS_LIMIT + 1, 1e30])
def test_token_limits_must_be_non_negative_ints(key: str, value: Any) -> None:
    assert rejects(InvalidRequest, chat(**{key: value})).param == key


@pytest.mark.parametrize("key", [b"max_tokens", b"max_completion_tokens"])
@pytest.mark.parametrize(
    ("digits", "param"),
    [
        (b"18446744073709551615", True),  # u64 max: an int, over the limit
        (b"9" * 30, True),  # orjson turns it into a float
        (b"-" + b"9" * 30, True),
        (b"9" * 400, False),  # infinity as a double: not valid JSON for orjson
    ],
)
def test_huge_integer_token_limits(key: bytes, digits: bytes, param: bool) -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"' + key + b'":' + digits + b"}"
    exc = rejects(InvalidRequest, raw)
    assert exc.param == (key.decode() if param else None)


def test_responses_max_output_tokens_validated() -> None:
    body = {"model": "r", "input": "x", "max_output_tokens": -5}
    exc = rejects(InvalidRequest, body, path=RESPONSES)
    assert exc.param == "max_output_tokens"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ("hi", "messages"),
        ([], "messages"),
        ({"role": "user"}, "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a"}, 3], "messages[1]"),
        ([{"content": "a"}], "messages[0].role"),
        ([{"role": 1, "content": "a"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"text": "a"}}], "messages[0].content"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_chat_messages_shape(messages: Any, param: str) -> None:
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    assert rejects(InvalidRequest, body).param == param


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (None, "prompt"),
        (5, "prompt"),
        ({"text": "a"}, "prompt"),
        (True, "prompt"),
        (["a", 1], "prompt"),
        ([1.5], "prompt"),
        ([True, False], "prompt"),
        ([[1, "a"]], "prompt[0]"),
        ([[1], 2], "prompt"),
    ],
)
def test_completions_prompt_shape(prompt: Any, param: str) -> None:
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    assert rejects(InvalidRequest, body, path=COMPLETIONS).param == param


@pytest.mark.parametrize("value", [None, 5, {"a": 1}, [{"a": 1}], False])
def test_embeddings_input_shape(value: Any) -> None:
    body = {"model": "e"} if value is None else {"model": "e", "input": value}
    assert rejects(InvalidRequest, body, path=EMBEDDINGS).param == "input"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "r"}, "input"),
        ({"model": "r", "input": 5}, "input"),
        ({"model": "r", "input": {"role": "user"}}, "input"),
        ({"model": "r", "input": ["text"]}, "input[0]"),
        ({"model": "r", "input": [{"role": "user", "content": 1}]}, "input[0].content"),
        ({"model": "r", "input": "x", "instructions": 5}, "instructions"),
    ],
)
def test_responses_input_shape(body: dict[str, Any], param: str) -> None:
    assert rejects(InvalidRequest, body, path=RESPONSES).param == param


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 10_000, 200_000])
def test_deep_nesting_is_400_not_a_crash(depth: int) -> None:
    # orjson 3.8 crashes the process (SIGSEGV) on ~100k levels: must never reach it.
    for raw in (
        b"[" * depth + b"]" * depth,
        b'{"a":' * depth + b"1" + b"}" * depth,
        b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}",
        b"[" * depth,  # unterminated
        b'["' + b"]" * depth + b'",' + b"[" * depth + b"]" * depth + b"]",  # decoy string
    ):
        exc = rejects(InvalidRequest, raw, limit=1 << 24)
        assert "nested" in exc.message


def test_nesting_at_the_limit_is_parsed() -> None:
    inner = b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1)
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + inner + b"}"
    assert parse(raw).model == "m"
    rejects(InvalidRequest, raw.replace(b'"x":[', b'"x":[['))


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"", 0),
        (b"1", 0),
        (b"[]", 1),
        (b"[[],[[]]]", 3),
        (b'["[[[["]', 1),
        (b'["\\"[[["]', 1),
        (b'["\\\\", [[]]]', 3),
        (b'["\\\\\\"[[", []]', 2),
        (b'{"a": {"b": "}}}{{{"}}', 2),
        (b"]]][[", 0),
    ],
)
def test_max_nesting_depth_examples(text: bytes, depth: int) -> None:
    assert max_nesting_depth(text) == depth


def test_error_param_indexes_are_exact() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": ["a"]}]
    assert rejects(InvalidRequest, chat(messages=msgs)).param == "messages[1].content[0]"
    msgs = [{"role": "user", "content": [{"text": "a"}, {"text": 1}]}] * 3
    assert rejects(InvalidRequest, chat(messages=msgs)).param == "messages[0].content[1].text"
    items = [{"type": "function_call"}, {"role": "user", "content": 5}]
    body = {"model": "r", "input": items}
    assert rejects(InvalidRequest, body, path=RESPONSES).param == "input[1].content"
    body = {"model": "m", "prompt": [[1], [2], [3, "x"]]}
    assert rejects(InvalidRequest, body, path=COMPLETIONS).param == "prompt[2]"


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"model": "m", "messages": [{"role": "u", "content": [{"text": "x"}]}] * 40_000}, CHAT),
        ({"model": "m", "messages": [{"role": "u", "content": "x"}] * 40_000}, CHAT),
        ({"model": "m", "prompt": [[1, 2, 3]] * 40_000}, COMPLETIONS),
        ({"model": "m", "input": ["ab"] * 40_000}, EMBEDDINGS),
        (
            {"model": "m", "input": [{"role": "u", "content": "x"}, {"type": "f"}] * 20_000},
            RESPONSES,
        ),
    ],
)
def test_many_items_parse_in_linear_time(body: dict[str, Any], path: str) -> None:
    """Regression: per-item work must not rescan earlier items (was quadratic: ~20 s)."""
    started = time.perf_counter()
    req = parse(body, path, limit=1 << 26)
    assert time.perf_counter() - started < 3.0
    assert req.prompt_tokens > 0
