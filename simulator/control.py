"""The fleet's control port: what tests and operators use when a pod itself cannot answer.

A crashed pod has no listener, so its own /admin API is gone; this app, served by the fleet
process on ``--control-port``, can still restart it or change its faults.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from simulator.faults import FaultError
from simulator.server import PodServer


def control_app(pods: Mapping[str, PodServer]) -> web.Application:
    """Routes: GET /pods; GET /pods/{name}/state; POST /pods/{name}/restart;
    POST /pods/{name}/crash; GET|POST|DELETE /pods/{name}/faults."""
    app = web.Application()

    def pod_of(request: web.Request) -> PodServer:
        pod = pods.get(request.match_info["name"])
        if pod is None:
            raise web.HTTPNotFound(text=f"no pod named {request.match_info['name']!r}")
        return pod

    async def list_pods(_request: web.Request) -> web.Response:
        return _json([_summary(p) for p in pods.values()])

    async def state(request: web.Request) -> web.Response:
        return _json(pod_of(request).state())

    async def restart(request: web.Request) -> web.Response:
        pod = pod_of(request)
        await pod.restart()
        return _json(_summary(pod))

    async def crash(request: web.Request) -> web.Response:
        pod = pod_of(request)
        await pod.crash()
        return _json(_summary(pod))

    async def get_faults(request: web.Request) -> web.Response:
        return _json(pod_of(request).faults.as_dict())

    async def post_faults(request: web.Request) -> web.Response:
        pod = pod_of(request)
        try:
            changes = orjson.loads(await request.read())
            if isinstance(changes, dict) and changes.get("crash") is True:
                pod.set_faults({k: v for k, v in changes.items() if k != "crash"})
                await pod.crash()
            else:
                pod.set_faults(changes)
        except (orjson.JSONDecodeError, FaultError) as e:
            return _json({"error": str(e)}, status=400)
        return _json(pod.faults.as_dict())

    async def delete_faults(request: web.Request) -> web.Response:
        pod = pod_of(request)
        pod.clear_faults()
        return _json(pod.faults.as_dict())

    app.router.add_get("/pods", list_pods)
    app.router.add_get("/pods/{name}/state", state)
    app.router.add_post("/pods/{name}/restart", restart)
    app.router.add_post("/pods/{name}/crash", crash)
    app.router.add_get("/pods/{name}/faults", get_faults)
    app.router.add_post("/pods/{name}/faults", post_faults)
    app.router.add_delete("/pods/{name}/faults", delete_faults)
    return app


def _summary(pod: PodServer) -> dict[str, object]:
    return {"name": pod.name, "url": pod.url, "host": pod.host, "port": pod.port, "up": pod.up,
            "engine": pod.spec.engine, "gpu": pod.spec.gpu, "model": pod.spec.model}


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")
