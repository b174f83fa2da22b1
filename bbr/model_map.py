"""Model name → pool, in one dict lookup, plus the pre-encoded `GET /v1/models` body.

Built from plain (pool, base model, LoRA adapters) tuples so bbr stays below the
picker in the layering: the picker's config feeds it, bbr never imports it.
A LoRA adapter routes to the pool serving its base model; the adapter name is
what the engine expects as `model`, so the body is forwarded unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import orjson

from bbr.request import InferenceRequest
from contract.errors import ModelNotFound

__all__ = ["OWNED_BY", "ModelMap", "Route"]

OWNED_BY = "inference-gateway"


@dataclass(frozen=True, slots=True)
class Route:
    """Where a model name goes: the pool, its base model, and the adapter if any."""

    pool: str
    base_model: str
    adapter: str | None


class ModelMap:
    """Immutable model → Route map; rebuild it when the config changes."""

    __slots__ = ("_bodies", "_list_body", "_routes")

    def __init__(self, routes: dict[str, Route], created: int) -> None:
        self._routes = routes
        cards = {name: _card(name, route, created) for name, route in routes.items()}
        self._bodies = {name: orjson.dumps(card) for name, card in cards.items()}
        self._list_body = orjson.dumps({"object": "list", "data": list(cards.values())})

    @classmethod
    def from_pools(
        cls, pools: Iterable[tuple[str, str, Sequence[str]]], *, created: int | None = None
    ) -> ModelMap:
        """Build from (pool_name, base_model, lora_adapters) tuples.

        Raises ValueError for an empty name or any name served twice (two pools, a
        pool listed twice, an adapter named like a model): routing must be unambiguous.
        `created` (Unix seconds) stamps the /v1/models cards; default: now.
        """
        routes: dict[str, Route] = {}
        seen_pools: set[str] = set()
        for pool, base_model, adapters in pools:
            if not pool or not base_model:
                raise ValueError(f"pool {pool!r}: pool name and base model must be non-empty")
            if pool in seen_pools:
                raise ValueError(f"pool {pool!r} is listed twice")
            seen_pools.add(pool)
            _add(routes, base_model, Route(pool, base_model, None))
            if isinstance(adapters, str):  # a lone string would iterate as characters
                raise ValueError(f"pool {pool!r}: lora adapters must be a list of names")
            for adapter in adapters:
                if not adapter:
                    raise ValueError(f"pool {pool!r}: empty lora adapter name")
                _add(routes, adapter, Route(pool, base_model, adapter))
        return cls(routes, int(time.time()) if created is None else created)

    def resolve(self, model: str) -> Route:
        """The route for a requested model name (exact match), or ModelNotFound (404)."""
        route = self._routes.get(model)
        if route is None:
            raise ModelNotFound(model)
        return route

    def apply(self, request: InferenceRequest) -> Route:
        """Resolve `request.model` and record the adapter / base model on the request."""
        route = self.resolve(request.model)
        request.adapter = route.adapter
        request.base_model = route.base_model
        return route

    def models_response(self) -> bytes:
        """The `GET /v1/models` body, OpenAI's list shape, encoded once at build time."""
        return self._list_body

    def model_response(self, model: str) -> bytes:
        """The `GET /v1/models/{model}` body, or ModelNotFound (404)."""
        body = self._bodies.get(model)
        if body is None:
            raise ModelNotFound(model)
        return body

    def __contains__(self, model: object) -> bool:
        return model in self._routes

    def __iter__(self) -> Iterator[str]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __repr__(self) -> str:
        return f"ModelMap({len(self._routes)} models)"


def _add(routes: dict[str, Route], name: str, route: Route) -> None:
    other = routes.get(name)
    if other is not None:
        raise ValueError(
            f"model name {name!r} is served twice (pool {other.pool!r} and pool {route.pool!r})"
        )
    routes[name] = route


def _card(name: str, route: Route, created: int) -> dict[str, object]:
    """One model object. Like vLLM: an adapter's `parent` is its base model and
    its `root` is itself; a base model is its own root with no parent."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "root": name,
        "parent": route.base_model if route.adapter is not None else None,
    }
