"""How request text becomes token counts, cache blocks and generated words.

The simulator never tokenizes for real: a token is approximated as 4 characters everywhere
(prompt length, block boundaries, usage figures), so the numbers the gateway computes from the
same text line up with the ones the pod reports.
"""

from __future__ import annotations

import math
import zlib
from hashlib import blake2b
from typing import Any

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
BLOCK_CHARS = CHARS_PER_TOKEN * BLOCK_TOKENS
_EMPTY = blake2b(digest_size=8)  # copying a primed hasher is cheaper than constructing one

# Generated text is drawn from this fixed vocabulary: ASCII words that need no JSON escaping,
# each one simulated token.
_LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud "
    "exercitation ullamco laboris nisi aliquip ex ea commodo consequat duis aute irure "
    "in reprehenderit voluptate velit esse cillum fugiat nulla pariatur excepteur sint "
    "occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est"
)
VOCAB: tuple[str, ...] = tuple(" " + w for w in _LOREM.split())


class PromptError(ValueError):
    """The request body has no usable prompt (becomes a 400)."""


def count_tokens(text: str) -> int:
    """Token estimate used for every figure the pod reports."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def chat_prompt_text(messages: Any) -> str:
    """Flatten chat messages the way a chat template would: role markers plus contents."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError("each message needs a string 'role'")
        parts.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    raise PromptError("message 'content' must be a string or a list of parts")


def completion_prompt_text(prompt: Any) -> str:
    """The text of a /v1/completions prompt; token-id lists count 4 characters per id."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt)
        if all(isinstance(p, int) for p in prompt):
            return "".join(f"{p:04d}"[-CHARS_PER_TOKEN:] for p in prompt)
    raise PromptError("'prompt' must be a string, a list of strings or a list of token ids")


def block_hashes(text: str, seed: str) -> list[int]:
    """Chained hashes of the prompt's full 64-character blocks.

    Each hash covers the whole prefix up to its block (it is chained on the previous one) and
    the chain is seeded by the served model or adapter name, so equal hashes mean an equal
    prefix for the same weights, as in vLLM's prefix cache. The function is the gateway's
    (docs/bbr.md, "Prefix hashing": BLAKE2b-64, little-endian), so a hash the gateway routed on
    names exactly the block this pod caches.
    """
    prev = blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    blocks = len(text) // BLOCK_CHARS
    data = text.encode("utf-8", "surrogatepass")
    ascii_only = len(data) == len(text)
    out: list[int] = []
    for i in range(blocks):
        start = i * BLOCK_CHARS
        chunk = (data[start : start + BLOCK_CHARS] if ascii_only
                 else text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        h = _EMPTY.copy()
        h.update(prev)
        h.update(chunk)
        prev = h.digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def word_offset(text: str, seed: int) -> int:
    """Where in VOCAB a request's output starts: a function of the seed and the prompt only."""
    return (zlib.crc32(text.encode("utf-8", "surrogatepass")) ^ seed) % len(VOCAB)


def word_ids(offset: int, start: int, stop: int) -> list[int]:
    """VOCAB indices of generated tokens start..stop-1 of a request whose output begins at
    offset (stride 7 over a prime-sized vocabulary: every word before any repeats)."""
    n = len(VOCAB)
    return [(offset + 7 * i) % n for i in range(start, stop)]
