"""The `InferenceGatewayConfig` custom resource: from API object to config, and back to status.

An object read from the API server carries server-owned metadata (uid,
managedFields, finalizers, ownerReferences...) that the strict file loader
would call unknown fields. Only the parts a user writes are handed to
`parse_config`, so a CR and a file with the same spec give the same config.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from contract.config import ConfigError, GatewayConfig, parse_config

GROUP = "inference-gateway.io"
VERSION = "v1alpha1"
KIND = "InferenceGatewayConfig"
PLURAL = "inferencegatewayconfigs"
CONDITION = "Accepted"
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class Outcome:
    """What happened to one generation of the resource, as a status condition says it."""

    accepted: bool
    reason: str
    message: str


def user_document(obj: dict[str, Any]) -> dict[str, Any]:
    """apiVersion, kind, name, namespace and spec: what the user wrote, nothing the server added."""
    meta = obj.get("metadata") or {}
    document: dict[str, Any] = {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {k: meta[k] for k in ("name", "namespace") if k in meta},
    }
    if "spec" in obj:
        document["spec"] = obj["spec"]
    return document


def config_from_object(obj: dict[str, Any]) -> GatewayConfig:
    """Validate a resource exactly like a file; raises ConfigError naming the field."""
    return parse_config(user_document(obj))


def evaluate(obj: dict[str, Any], apply: Any) -> tuple[GatewayConfig | None, Outcome]:
    """Parse the resource and, when valid, hand it to `apply` (returns whether it took it)."""
    try:
        config = config_from_object(obj)
    except ConfigError as exc:
        return None, Outcome(False, "Invalid", str(exc)[:MAX_MESSAGE])
    if not apply(config):
        return config, Outcome(
            False,
            "NotApplied",
            "valid, but the running gateway refused it (listener/ports/failureMode "
            "changes need a restart); the previous config stays in force",
        )
    pools = ", ".join(s.name for s in config.schedulers)
    return config, Outcome(True, "Applied", f"applied; pools: {pools}"[:MAX_MESSAGE])


def status_patch(outcome: Outcome, generation: int | None, pools: int) -> dict[str, Any]:
    """A merge patch for `.status`: one Accepted condition, the generation it is about,
    and how many pools the gateway serves now (the previous config's when refused)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition: dict[str, Any] = {
        "type": CONDITION,
        "status": "True" if outcome.accepted else "False",
        "reason": outcome.reason,
        "message": outcome.message,
        "lastTransitionTime": now,
    }
    status: dict[str, Any] = {"conditions": [condition], "pools": pools}
    if generation is not None:
        condition["observedGeneration"] = generation
        status["observedGeneration"] = generation
    return {"status": status}
