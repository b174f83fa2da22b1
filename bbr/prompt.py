"""Prompt extraction: a parsed request object → the prompt text, per API.

Each API keeps its prompt in its own fields (chat `messages`, completions
`prompt`, embeddings `input` or `messages`, responses `instructions` +
`input`); `prompt_text` flattens them into one text shaped like a chat
template, which is what prefix affinity hashes, and validates exactly those
fields (a 400 names the offending one). It runs once per request on the
picker's hot path, on the object bbr.json_body produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bbr.json_body import kind
from contract.errors import InvalidRequest

__all__ = ["PROMPT_CHAR_CAP", "prompt_text"]

# Prompt text kept for prefix hashing (characters). Token estimates still count
# the whole prompt; only the kept text is capped. 256 KiB = 4096 blocks of 64.
PROMPT_CHAR_CAP = 256 * 1024
# Characters one token id stands for in the prompt text (4 chars ≈ 1 token).
_TOKEN_ID_CHARS = 4

_ROLE_HEADS = {r: f"<|{r}|>\n" for r in ("system", "developer", "user", "assistant", "tool")}
_ASSISTANT_HEAD = _ROLE_HEADS["assistant"]


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


# ---------------------------------------------------------------- shared shapes


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
            f"`{param}` must be a string or an array of content parts, not {kind(content)}.",
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
            raise InvalidRequest(f"`{where}` must be an object, not {kind(message)}.", param=where)
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
            f"`{param}` must be a string or an array, not {kind(value)}.", param=param
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


# ---------------------------------------------------------------- one per API


def _chat(data: dict[str, Any], text: _PromptText) -> None:
    _chat_text(data.get("messages"), text, generation_prompt=True)


def _completions(data: dict[str, Any], text: _PromptText) -> None:
    prompt = data.get("prompt")
    if prompt is None and data.get("prompt_embeds") is None:
        raise InvalidRequest("You must provide a `prompt`.", param="prompt")
    if prompt is not None:
        _prompt_value(prompt, text, "prompt")


def _embeddings(data: dict[str, Any], text: _PromptText) -> None:
    value = data.get("input")
    if value is not None:
        _prompt_value(value, text, "input")
    elif data.get("messages") is not None:  # vLLM's chat-style embeddings request
        _chat_text(data["messages"], text, generation_prompt=False)
    else:
        raise InvalidRequest("You must provide an `input`.", param="input")


def _responses(data: dict[str, Any], text: _PromptText) -> None:
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
            f"`input` must be a string or an array of items, not {kind(value)}.", param="input"
        )
    text.append(_ASSISTANT_HEAD)


_API_PROMPTS: dict[str, Callable[[dict[str, Any], _PromptText], None]] = {
    "chat": _chat,
    "completions": _completions,
    "embeddings": _embeddings,
    "responses": _responses,
}


def prompt_text(api: str, data: dict[str, Any]) -> tuple[str, int]:
    """(prompt text capped at PROMPT_CHAR_CAP characters, characters of the whole
    prompt) of one request of `api` ("chat", "completions", "embeddings",
    "responses"); an InvalidRequest names the first malformed prompt field."""
    text = _PromptText(PROMPT_CHAR_CAP)
    _API_PROMPTS[api](data, text)
    return text.finish()
