"""Body-based routing: parse a request body once, find its pool, hash its prefix.

The first layer of the picker's request path; it imports only `contract`.

    req = parse_request(body, path, content_type, content_encoding, limit)
    route = model_map.apply(req)              # ModelNotFound -> 404
    hashes = prefix_hashes(req.model, req.prompt, max_blocks)

Inside, `parse_request` (request.py) is the JSON guard (json_body.py: bytes →
a validated JSON object) followed by prompt extraction (prompt.py: object →
prompt text per API). Every client-visible failure is a
`contract.errors.ApiError`; the handler turns it into a response with
`error_body` / `error_headers`. Contract and error table: docs/bbr.md.
"""

from bbr.json_body import MAX_NESTING, max_nesting_depth
from bbr.model_map import ModelMap, Route
from bbr.prefix import BLOCK_CHARS, DEFAULT_MAX_BLOCKS, model_seed, prefix_hashes
from bbr.prompt import PROMPT_CHAR_CAP
from bbr.request import API_PATHS, DEFAULT_MAX_TOKENS, InferenceRequest, parse_request

__all__ = [
    "API_PATHS",
    "BLOCK_CHARS",
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_TOKENS",
    "MAX_NESTING",
    "PROMPT_CHAR_CAP",
    "InferenceRequest",
    "ModelMap",
    "Route",
    "max_nesting_depth",
    "model_seed",
    "parse_request",
    "prefix_hashes",
]
