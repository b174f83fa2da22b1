"""The admin gRPC service (proto/admin.proto): state, explain, drain."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from contract.errors import ApiError
from picker.director import RequestInfo
from proto import admin_pb2, admin_pb2_grpc

if TYPE_CHECKING:
    from picker.app import PickerApp
    from picker.datastore import Pool


def _pod_state(pool: Pool, address: str, now: float) -> admin_pb2.PodState:
    pod = pool.pods[address]
    t, row = pool.table, pod.row
    stale_after = pool.config.metrics.stale_after_s
    age = now - t.scraped_at[row] if t.scraped_at[row] > 0 else float("inf")
    adapters = [name for name, slot in pool.adapter_index.items() if t.lora_running[row, slot]]
    return admin_pb2.PodState(
        address=address,
        name=pod.name,
        ready=bool(t.ready[row]),
        draining=bool(t.draining[row]),
        metrics_fresh=bool(t.metrics_ok[row]) and age <= stale_after,
        metrics_age_s=age,
        waiting=float(t.waiting[row]),
        running=float(t.running[row]),
        kv_cache_usage=float(t.kv_usage[row]),
        inflight=float(t.inflight[row]),
        dispatched_since_scrape=float(t.dispatched[row]),
        outstanding_prefill_tokens=float(t.outstanding_prefill[row]),
        prefill_tokens_per_s=float(t.prefill_tps[row]),
        decode_step_s=float(t.decode_step_s[row]),
        ttft_s=float(t.ttft_s[row]),
        running_lora_adapters=adapters,
        picks=int(t.picks[row]),
    )


class AdminService(admin_pb2_grpc.GatewayAdminServicer):
    def __init__(self, app: PickerApp) -> None:
        self.app = app

    async def ListPools(self, request, context):
        now = time.monotonic()
        pools = []
        for pool in self.app.datastore.pools.values():
            queue = self.app.director.admission.get(pool.name)
            pools.append(
                admin_pb2.PoolState(
                    name=pool.name,
                    model_name=pool.config.model_name,
                    scheduler=pool.config.scheduler,
                    lora_adapters=list(pool.config.lora_adapters),
                    pods=[_pod_state(pool, a, now) for a in pool.pods],
                    saturated=self.app.director.saturated(pool, now),
                    admission_queue_length=len(queue) if queue is not None else 0,
                )
            )
        return admin_pb2.ListPoolsResponse(
            pools=pools, coordination=self._coordination(), tenants=self._tenants()
        )

    def _coordination(self) -> admin_pb2.CoordinationState:
        coordinator = self.app.coordination
        if coordinator is None:
            return admin_pb2.CoordinationState(enabled=False)
        return admin_pb2.CoordinationState(enabled=True, **coordinator.status())

    def _tenants(self) -> admin_pb2.TenantsState:
        config = self.app.config.tenants
        if config is None:
            return admin_pb2.TenantsState(enabled=False)
        director = self.app.director
        states = [s.state.shares for s in director.schedulers.values()]
        tenants = [
            admin_pb2.TenantState(
                name=t.name, weight=t.weight, requests=t.usage.requests,
                prompt_tokens=t.usage.prompt_tokens, output_tokens=t.usage.output_tokens,
                rate_limited=t.usage.rate_limited,
                inflight=sum(shares.inflight(t.name) for shares in states),
            )
            for t in director.tenants.tenants.values()
        ]
        stats = director.tenants.stats
        limits = director.limiter.status() if director.limiter is not None else {}
        return admin_pb2.TenantsState(
            enabled=True, tenants=tenants, limits_redis=limits.get("redis", "off"),
            limits_mode=limits.get("mode", "local"), limits_replicas=limits.get("replicas", 1),
            unauthorized=stats.missing + stats.invalid + stats.unknown_tenant,
            measure_usage=director.ledger is not None,
        )

    async def Explain(self, request, context):
        info = RequestInfo(
            path=request.path or "/v1/chat/completions",
            content_type=request.headers.get("content-type", "application/json"),
            content_encoding=request.headers.get("content-encoding"),
            priority=request.headers.get("x-gateway-priority"),
            criticality=request.headers.get("x-gateway-criticality"),
        )
        try:
            result = self.app.director.explain(request.body, info)
        except ApiError as exc:
            return admin_pb2.ExplainResponse(error_status=exc.status, error_message=exc.message)
        return admin_pb2.ExplainResponse(
            pool=result["pool"],
            model=result["model"],
            adapter=result.get("adapter") or "",
            picked=result["picked"],
            pods=[
                admin_pb2.PodScore(
                    address=p["address"],
                    total=p.get("total", 0.0),
                    scores=p.get("scores", {}),
                    filtered_reason=p.get("filtered_reason", ""),
                )
                for p in result["pods"]
            ],
        )

    async def SetDrain(self, request, context):
        pool = self.app.datastore.pools.get(request.pool)
        pod = pool.pods.get(request.address) if pool is not None else None
        if pod is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no pod {request.address!r} in pool {request.pool!r}"
            )
        changed = bool(pool.table.draining[pod.row]) != request.drain
        pool.table.draining[pod.row] = request.drain
        return admin_pb2.SetDrainResponse(changed=changed)
