"""OpenAI-compatible response bodies as vLLM writes them, pre-encoded for cheap streaming.

A streamed token costs one bytes concatenation: each request builds its chunk prefix and
suffix once with orjson, and every vocabulary word is JSON-encoded once at import.
"""

from __future__ import annotations

from typing import Any

import orjson

from simulator.tokens import VOCAB

WORD_JSON: tuple[bytes, ...] = tuple(orjson.dumps(w) for w in VOCAB)
DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, err_type: str, code: int) -> bytes:
    """vLLM's error shape (what a client of a real pod parses)."""
    return orjson.dumps(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": code}
    )


def model_not_found(model: str) -> bytes:
    return error_body(f"The model `{model}` does not exist.", "NotFoundError", 404)


def models_body(base: str, adapters: list[str], created: int, max_model_len: int) -> bytes:
    """GET /v1/models: the base model, then each adapter with ``parent`` = base."""
    def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": max_model_len,
                "permission": []}

    data = [card(base, base, None)] + [card(a, f"/adapters/{a}", base) for a in adapters]
    return orjson.dumps({"object": "list", "data": data})


class StreamFormat:
    """SSE chunks of one streamed request (chat.completion.chunk or text_completion)."""

    def __init__(self, chat: bool, req_id: str, model: str, created: int,
                 include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._envelope = (
            b'{"id":' + orjson.dumps(req_id) + b',"object":"' + obj.encode()
            + b'","created":' + str(created).encode() + b',"model":' + orjson.dumps(model)
        )
        head = b"data: " + self._envelope + b',"choices":[{"index":0,'
        if chat:
            self._head = head + b'"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._head = head + b'"text":'
            self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def role_chunk(self) -> bytes:
        """vLLM opens a chat stream with an empty assistant delta."""
        if not self.chat:
            return b""
        return (b"data: " + self._envelope + b',"choices":[{"index":0,"delta":{"role":'
                b'"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')

    def tokens(self, ids: list[int]) -> bytes:
        head, tail = self._head, self._tail
        return b"".join(head + WORD_JSON[i] + tail for i in ids)

    def finish(self, reason: str, usage_obj: dict[str, Any]) -> bytes:
        """Last chunk with finish_reason, the usage chunk if asked for, then [DONE]."""
        delta = b'"delta":{}' if self.chat else b'"text":""'
        out = [
            b"data: " + self._envelope + b',"choices":[{"index":0,' + delta
            + b',"logprobs":null,"finish_reason":' + orjson.dumps(reason)
            + b',"stop_reason":null}]}\n\n'
        ]
        if self.include_usage:
            out.append(b"data: " + self._envelope + b',"choices":[],"usage":'
                       + orjson.dumps(usage_obj) + b"}\n\n")
        out.append(DONE)
        return b"".join(out)


def completion_body(chat: bool, req_id: str, model: str, created: int, text: str,
                    reason: str, usage_obj: dict[str, Any]) -> bytes:
    """Non-streamed chat.completion or text_completion."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None, "finish_reason": reason, "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                  "stop_reason": None, "prompt_logprobs": None}
        obj = "text_completion"
    return orjson.dumps({"id": req_id, "object": obj, "created": created, "model": model,
                         "choices": [choice], "usage": usage_obj})
