"""bbr.model_map: model → pool routing (LoRA adapters included) and /v1/models."""

from __future__ import annotations

import orjson
import pytest

from bbr.model_map import ModelMap, Route
from bbr.request import parse_request
from contract.errors import ModelNotFound, error_body

POOLS = [
    ("llama-pool", "llama-3.1-8b", ["sql-lora", "chat-lora"]),
    ("qwen-pool", "qwen-2.5-7b", []),
]


@pytest.fixture
def model_map() -> ModelMap:
    return ModelMap.from_pools(POOLS, created=1700000000)


def test_resolve_base_models(model_map: ModelMap) -> None:
    assert model_map.resolve("llama-3.1-8b") == Route("llama-pool", "llama-3.1-8b", None)
    assert model_map.resolve("qwen-2.5-7b") == Route("qwen-pool", "qwen-2.5-7b", None)


def test_lora_adapter_routes_to_base_pool(model_map: ModelMap) -> None:
    assert model_map.resolve("sql-lora") == Route("llama-pool", "llama-3.1-8b", "sql-lora")
    assert model_map.resolve("chat-lora").pool == "llama-pool"


def test_unknown_model_is_404_naming_it(model_map: ModelMap) -> None:
    with pytest.raises(ModelNotFound) as info:
        model_map.resolve("gpt-4o")
    assert info.value.status == 404
    body = orjson.loads(error_body(info.value))["error"]
    assert body["code"] == "model_not_found"
    assert "`gpt-4o`" in body["message"]


def test_resolve_is_exact_match(model_map: ModelMap) -> None:
    for name in ("LLAMA-3.1-8B", "llama-3.1-8b ", "sql-lora/", ""):
        with pytest.raises(ModelNotFound):
            model_map.resolve(name)


def test_apply_fills_request(model_map: ModelMap) -> None:
    raw = orjson.dumps({"model": "sql-lora", "messages": [{"role": "user", "content": "x"}]})
    req = parse_request(raw, "/v1/chat/completions", "application/json", None, 1 << 20)
    route = model_map.apply(req)
    assert route.pool == "llama-pool"
    assert (req.model, req.adapter, req.base_model) == ("sql-lora", "sql-lora", "llama-3.1-8b")


def test_models_response_shape(model_map: ModelMap) -> None:
    body = orjson.loads(model_map.models_response())
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": "llama-3.1-8b", "object": "model", "created": 1700000000,
         "owned_by": "inference-gateway", "root": "llama-3.1-8b", "parent": None},
        {"id": "sql-lora", "object": "model", "created": 1700000000,
         "owned_by": "inference-gateway", "root": "sql-lora", "parent": "llama-3.1-8b"},
        {"id": "chat-lora", "object": "model", "created": 1700000000,
         "owned_by": "inference-gateway", "root": "chat-lora", "parent": "llama-3.1-8b"},
        {"id": "qwen-2.5-7b", "object": "model", "created": 1700000000,
         "owned_by": "inference-gateway", "root": "qwen-2.5-7b", "parent": None},
    ]  # fmt: skip


def test_models_response_is_encoded_once(model_map: ModelMap) -> None:
    assert model_map.models_response() is model_map.models_response()


def test_model_response_single(model_map: ModelMap) -> None:
    assert orjson.loads(model_map.model_response("chat-lora"))["parent"] == "llama-3.1-8b"
    with pytest.raises(ModelNotFound):
        model_map.model_response("nope")


def test_container_protocol(model_map: ModelMap) -> None:
    assert len(model_map) == 4
    assert "sql-lora" in model_map and "nope" not in model_map
    assert list(model_map) == ["llama-3.1-8b", "sql-lora", "chat-lora", "qwen-2.5-7b"]


def test_empty_map_lists_nothing() -> None:
    empty = ModelMap.from_pools([])
    assert orjson.loads(empty.models_response()) == {"object": "list", "data": []}
    with pytest.raises(ModelNotFound):
        empty.resolve("x")


def test_created_defaults_to_now() -> None:
    card = orjson.loads(ModelMap.from_pools(POOLS).models_response())["data"][0]
    assert card["created"] > 1700000000


def test_accepts_generators_and_tuples() -> None:
    mm = ModelMap.from_pools((name, base, tuple(a)) for name, base, a in POOLS)
    assert mm.resolve("sql-lora").adapter == "sql-lora"


@pytest.mark.parametrize(
    "pools",
    [
        [("a", "m", []), ("b", "m", [])],  # model in two pools
        [("a", "m", ["x"]), ("b", "n", ["x"])],  # adapter in two pools
        [("a", "m", ["n"]), ("b", "n", [])],  # adapter named like a base model
        [("a", "m", ["m"])],  # adapter named like its own base
        [("a", "m", ["x", "x"])],  # adapter listed twice
        [("a", "m", []), ("a", "n", [])],  # pool listed twice
        [("", "m", [])],
        [("a", "", [])],
        [("a", "m", [""])],
        [("a", "m", "lora")],  # a string, not a list of names
    ],
)
def test_ambiguous_or_empty_config_is_rejected(pools: list) -> None:
    with pytest.raises(ValueError):
        ModelMap.from_pools(pools)
