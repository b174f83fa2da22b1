"""The Tier-1 load summary: each pool's load, compact, for the global router (docs/global.md).

The global tier places a request on a region (a whole Tier-1 gateway) and
needs, per model, what a Tier-1 picker already knows: how many pods are
ready, what waits in the gateway's admission queue and in the engines, the
work committed to the pool (picker.scheduling.flow), whether it is saturated,
and the predicted time to first token of a typical request on the pod the
picker would choose now. The summary is built here in the background every
`interval_s` from the datastore and the schedulers' state and kept as
encoded bytes, so serving it (`GET /igw/v1/load-summary`, through Envoy's
TLS listener, igw_envoy.routes.load_summary_routes) costs a dict lookup and a
write, and requests never pay for it.

`generation` counts rebuilds: a reader that sees it stop moving knows the
picker is stuck even while something still answers. `generatedAt` is wall
clock (Unix seconds), for humans and logs; readers judge freshness on their
own clock (regions' clocks need not agree).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from picker.scheduling.context import ScoringContext
from picker.scheduling.flow import committed, routable_rows
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import candidate_pods
from picker.scheduling.scorers.latency import DEFAULT_BATCH_CAPACITY, predicted_ttft

if TYPE_CHECKING:
    from picker.director import Director

log = logging.getLogger("picker.load_summary")

SUMMARY_VERSION = 1
DEFAULT_INTERVAL_S = 0.25


def pool_summary(director: Director, name: str, now: float) -> dict[str, Any]:
    """One pool's entry: what the global router places on (see docs/global.md)."""
    pool = director.datastore.pools[name]
    sched = director.schedulers[name]
    state = sched.state
    t = pool.table
    valid = t.valid
    ready = candidate_pods(pool, now)
    queue = director.admission.get(name)
    work = committed(state, now)
    typical = SchedulingRequest(model=pool.config.model_name)
    typical.prompt_tokens = int(state.prompt_estimate(typical))
    ttft, tps = _typical_ttft(director, name, typical, now)
    return {
        "pool": name,
        "model": pool.config.model_name,
        "adapters": list(pool.config.lora_adapters),
        "pods": int(valid.sum()),
        "readyPods": int(ready.sum()),
        "queueLength": len(queue) if queue is not None else 0,
        "engineWaiting": float(t.waiting[ready].sum()),
        "running": float(t.running[ready].sum()),
        "committedRequests": work.requests,
        "committedPrefillTokens": round(work.prefill_tokens, 1),
        "saturation": round(work.saturation, 4),
        "saturated": director.saturated(pool, now),
        "predictedTtftS": ttft,
        "typicalPromptTokens": typical.prompt_tokens,
        "prefillTokensPerS": tps,
    }


def _typical_ttft(director: Director, name: str, typical: SchedulingRequest, now: float
                  ) -> tuple[float | None, float | None]:
    """Predicted TTFT of `typical` on the pod it would get now (the best routable one,
    by the predictedLatency model, no prefix hit), and that pod's prefill speed (tokens/s:
    the global router scales the prediction to each request's own prompt with it);
    None, None when no pod is routable."""
    pool = director.datastore.pools[name]
    state = director.schedulers[name].state
    rows = routable_rows(state, now)
    if not len(rows):
        return None, None
    ctx = ScoringContext(pool, state, typical, rows, now)
    ttft = predicted_ttft(ctx, float(DEFAULT_BATCH_CAPACITY))
    best = int(np.argmin(ttft))
    return round(float(ttft[best]), 4), round(float(ctx.speeds()[0][best]), 1)


class LoadSummary:
    """The summary document, rebuilt in the background; `body` is what is served."""

    def __init__(self, director: Director, gateway: str,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.director = director
        self.gateway = gateway
        self.interval_s = interval_s
        self.generation = 0
        self.serving = True
        self.body = b""
        self.rebuild()

    def document(self, now: float) -> dict[str, Any]:
        pools = [pool_summary(self.director, name, now) for name in self.director.schedulers]
        return {
            "version": SUMMARY_VERSION,
            "gateway": self.gateway,
            "generation": self.generation,
            "generatedAt": round(time.time(), 3),
            "intervalS": self.interval_s,
            "serving": self.serving,
            "pools": pools,
        }

    def rebuild(self) -> None:
        self.generation += 1
        self.body = orjson.dumps(self.document(time.monotonic()))

    async def run(self, stopping: asyncio.Event) -> None:
        """Rebuild every interval until `stopping` is set."""
        while not stopping.is_set():
            await asyncio.sleep(self.interval_s)
            try:
                self.rebuild()
            except Exception:  # a summary bug must not end the loop: the old body stays
                log.exception("load summary rebuild failed")

    def stop_serving(self) -> None:
        """The picker drains: say so at once (the global router stops placing here)."""
        self.serving = False
        self.rebuild()
