"""Client side of the picker's admin API, for `igw status|explain|drain`."""

from __future__ import annotations

import grpc
import orjson
from google.protobuf.json_format import MessageToDict

from proto import admin_pb2, admin_pb2_grpc

TIMEOUT_S = 5.0


def _stub(address: str) -> tuple[grpc.Channel, admin_pb2_grpc.GatewayAdminStub]:
    channel = grpc.insecure_channel(address)
    return channel, admin_pb2_grpc.GatewayAdminStub(channel)


def list_pools(address: str) -> list[dict]:
    return status(address)["pools"]


def status(address: str) -> dict:
    """`{"pools": [...], "tenants": {...}, "coordination": {...}}`: what `igw status`
    shows."""
    channel, stub = _stub(address)
    with channel:
        reply = stub.ListPools(admin_pb2.ListPoolsRequest(), timeout=TIMEOUT_S)
    return {
        "pools": [MessageToDict(p, preserving_proto_field_name=True) for p in reply.pools],
        "tenants": MessageToDict(
            reply.tenants, preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ),
        "coordination": MessageToDict(
            reply.coordination, preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ),
    }


def explain(address: str, body: bytes, path: str) -> dict:
    channel, stub = _stub(address)
    with channel:
        reply = stub.Explain(admin_pb2.ExplainRequest(body=body, path=path), timeout=TIMEOUT_S)
    return MessageToDict(reply, preserving_proto_field_name=True)


def explain_body(model: str | None, prompt: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]})


def set_drain(address: str, pool: str, pod: str, drain: bool) -> bool:
    channel, stub = _stub(address)
    with channel:
        reply = stub.SetDrain(
            admin_pb2.SetDrainRequest(pool=pool, address=pod, drain=drain), timeout=TIMEOUT_S
        )
    return reply.changed


def format_coordination(state: dict) -> str:
    """One line: is this replica routing with the others, and how far behind."""
    if not state.get("enabled"):
        return "coordination off (this replica routes on its own requests only)"
    lag = state.get("lag_s", "NaN")
    lag_text = "-" if lag in ("NaN", None) else f"{float(lag) * 1000:.1f}ms"
    link = "connected" if state.get("connected") else "DISCONNECTED (routing on local state)"
    line = (
        f"coordination {link} replica={state.get('replica', '')} "
        f"peers={','.join(state.get('peers', [])) or '-'} "
        f"remote_inflight={state.get('remote_inflight', 0)} lag={lag_text} "
        f"buffered={state.get('buffered', 0)} dropped={state.get('dropped', 0)} "
        f"reconnects={state.get('reconnects', 0)}"
    )
    if state.get("share_scrapes"):
        line += (f" scrapes=owner:{state.get('scrape_owner', 0)},"
                 f"shared:{state.get('scrape_shared', 0)},"
                 f"fallback:{state.get('scrape_fallback', 0)}")
    if state.get("last_error") and not state.get("connected"):
        line += f" last_error={state['last_error']!r}"
    return line


def format_tenants(state: dict) -> list[str]:
    """A line for the tenants' limits, then one per tenant (nothing without tenants)."""
    if not state.get("enabled"):
        return []
    lines = [
        f"tenants limits={state.get('limits_mode', 'local')} "
        f"redis={state.get('limits_redis', 'off')} replicas={state.get('limits_replicas', 1)} "
        f"unauthorized={state.get('unauthorized', 0)} "
        f"output_tokens={'measured' if state.get('measure_usage') else 'off'}"
    ]
    for t in state.get("tenants", []):
        lines.append(
            f"  {t['name']:<22} weight={float(t.get('weight', 1)):g} "
            f"inflight={t.get('inflight', 0)} requests={t.get('requests', 0)} "
            f"prompt_tokens={t.get('prompt_tokens', 0)} "
            f"output_tokens={t.get('output_tokens', 0)} rate_limited={t.get('rate_limited', 0)}"
        )
    return lines


def format_status(pools: list[dict], coordination: dict | None = None,
                  tenants: dict | None = None) -> str:
    """One line per pod: the figures an operator looks at first (and, given, one line
    for the link to the other replicas, and the tenants)."""
    lines = [] if coordination is None else [format_coordination(coordination)]
    lines += format_tenants(tenants or {})
    for pool in pools:
        lines.append(
            f"pool {pool['name']} model={pool['model_name']} scheduler={pool['scheduler']} "
            f"saturated={pool.get('saturated', False)} "
            f"queued={pool.get('admission_queue_length', 0)}"
        )
        for pod in pool.get("pods", []):
            lines.append(
                f"  {pod['address']:<22} ready={pod.get('ready', False)!s:<5} "
                f"fresh={pod.get('metrics_fresh', False)!s:<5} "
                f"drain={pod.get('draining', False)!s:<5} "
                f"wait={pod.get('waiting', 0):>4.0f} run={pod.get('running', 0):>4.0f} "
                f"kv={pod.get('kv_cache_usage', 0):.2f} inflight={pod.get('inflight', 0):.0f} "
                f"picks={pod.get('picks', 0)}"
            )
    return "\n".join(lines)
