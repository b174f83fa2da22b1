"""Kubernetes discovery against a mock of the API server, because none can run here.

`MockApiServer` (aiohttp, loopback) speaks the parts of the real list/watch
protocol the picker uses, as the API server does:

- `GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...` → a `PodList` whose
  `metadata.resourceVersion` is the snapshot's version;
- the same with `watch=true&resourceVersion=N` → a chunked stream of
  newline-delimited JSON events (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`)
  newer than N, ended cleanly after `timeoutSeconds`; a version older than
  the retained history gets a `410 Gone` (an `ERROR` event with a `Status`,
  or the HTTP status, both of which real servers send);
- the same two for `inferencegatewayconfigs` (with `fieldSelector`
  `metadata.name=NAME`), plus a merge `PATCH` of their `status` subresource.

The test controls it: change pods, hold events back, compact the history,
expire or cut open watches. The client is the real one (lightkube) pointed at
`http://127.0.0.1:PORT` through a generated kubeconfig.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from lightkube import AsyncClient, KubeConfig

from contract.config import GatewayConfig, parse_config
from picker.datastore import Datastore
from picker.discovery import start_discovery
from picker.discovery.config_resource import user_document
from picker.discovery.kubernetes import KubernetesDiscovery
from picker.discovery.pods import PodView, endpoint, members
from picker.discovery.settings import ConfigResource, DiscoverySettings, SettingsError

pytestmark = pytest.mark.timeout(60)

NS = "models"
ROOT = Path(__file__).resolve().parent.parent
PODS = f"/api/v1/namespaces/{NS}/pods"
CRS = f"/apis/inference-gateway.io/v1alpha1/namespaces/{NS}/inferencegatewayconfigs"


# -- the mock API server -------------------------------------------------------


def _labels_match(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key) != value:
            return False
    return True


def _fields_match(selector: str, obj: dict[str, Any]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        assert key == "metadata.name", key
        if obj["metadata"]["name"] != value:
            return False
    return True


def _json(body: Any, status: int = 200) -> web.Response:
    """JSON with exactly `application/json`, as the API server sends it (no charset)."""
    return web.Response(
        body=json.dumps(body).encode(), status=status, headers={"Content-Type": "application/json"}
    )


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class MockApiServer:
    """Objects, a global resourceVersion, an event history, and open watches."""

    def __init__(self) -> None:
        self.rv = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "configs": {}}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []
        self.compacted = 0  # watches from a version below this get 410 Gone
        self.gone_as_http = False  # 410 as the HTTP status instead of an ERROR event
        self.hold = False  # record events but deliver none (a partitioned watch)
        self.fail_lists = 0  # answer this many list requests with 503
        self.expire_epoch = 0
        self.changed = asyncio.Condition()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.patches: list[dict[str, Any]] = []
        self.open_watches: set[asyncio.Transport] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    # control

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PODS, self._pods)
        app.router.add_get(CRS, self._configs)
        app.router.add_patch(CRS + "/{name}/status", self._patch_status)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    async def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        old = self.objects[kind].get(name)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "configs":
            generation = (old or {}).get("metadata", {}).get("generation", 0)
            if old is None or old.get("spec") != obj.get("spec"):
                generation += 1
            obj["metadata"]["generation"] = generation
            obj.setdefault("status", (old or {}).get("status", {}))
        self.objects[kind][name] = obj
        await self._event(kind, "MODIFIED" if old else "ADDED", obj)
        return obj

    async def delete(self, kind: str, name: str) -> None:
        obj = copy.deepcopy(self.objects[kind].pop(name))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        await self._event(kind, "DELETED", obj)

    async def _event(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        self.history.append((self.rv, kind, etype, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()

    async def release(self) -> None:
        """Deliver what `hold` kept back."""
        self.hold = False
        async with self.changed:
            self.changed.notify_all()

    async def expire_watches(self) -> None:
        """Compact the history and tell every open watch its version is gone (ERROR 410)."""
        self.compacted = self.rv
        self.expire_epoch += 1
        async with self.changed:
            self.changed.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk)."""
        for transport in list(self.open_watches):
            transport.close()
        self.open_watches.clear()

    def count(self, path: str, watch: bool) -> int:
        return sum(1 for _, p, q in self.requests if p == path and ("watch" in q) == watch)

    # protocol

    def _matches(self, kind: str, query: dict[str, str], obj: dict[str, Any]) -> bool:
        labels = obj["metadata"].get("labels") or {}
        return _labels_match(query.get("labelSelector", ""), labels) and _fields_match(
            query.get("fieldSelector", ""), obj
        )

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pods", "PodList")

    async def _configs(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "configs", "InferenceGatewayConfigList")

    async def _collection(
        self, request: web.Request, kind: str, list_kind: str
    ) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.method, request.path, query))
        if query.get("watch") in ("true", "1"):
            return await self._watch(request, kind, query)
        if self.fail_lists > 0:
            self.fail_lists -= 1
            return _json(_status(503, "ServiceUnavailable", "etcd is sad"), status=503)
        items = [o for o in self.objects[kind].values() if self._matches(kind, query, o)]
        return _json(
            {
                "kind": list_kind,
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        )

    async def _watch(
        self, request: web.Request, kind: str, query: dict[str, str]
    ) -> web.StreamResponse:
        since_text = query.get("resourceVersion")
        since = int(since_text) if since_text else None
        if since is not None and since < self.compacted and self.gone_as_http:
            message = f"too old resource version: {since} ({self.compacted})"
            return _json(_status(410, "Expired", message), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        transport = request.transport
        assert transport is not None
        self.open_watches.add(transport)
        epoch = self.expire_epoch
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 3600)

        async def send(etype: str, obj: dict[str, Any]) -> None:
            line = json.dumps({"type": etype, "object": obj}) + "\n"
            await response.write(line.encode())

        try:
            if since is not None and since < self.compacted:
                message = f"too old resource version: {since} ({self.compacted})"
                await send("ERROR", _status(410, "Expired", message))
                return response
            if since is None:  # "start at most recent": synthetic ADDED for what exists
                for obj in list(self.objects[kind].values()):
                    if self._matches(kind, query, obj):
                        await send("ADDED", obj)
                since = self.rv
            bookmark = {"kind": "Pod", "apiVersion": "v1"}
            await send("BOOKMARK", {**bookmark, "metadata": {"resourceVersion": str(since)}})
            while time.monotonic() < deadline:
                if self.expire_epoch != epoch:
                    message = f"too old resource version: {since} ({self.compacted})"
                    await send("ERROR", _status(410, "Expired", message))
                    return response
                if not self.hold:
                    for rv, k, etype, obj in list(self.history):
                        if rv > since and k == kind and self._matches(kind, query, obj):
                            await send(etype, obj)
                        since = max(since, rv) if rv > since and k == kind else since
                async with self.changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), 0.2)
            return response
        except (ConnectionResetError, RuntimeError):
            return response
        finally:
            self.open_watches.discard(transport)

    async def _patch_status(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await request.json()
        self.requests.append((request.method, request.path, {}))
        self.patches.append(body)
        obj = copy.deepcopy(self.objects["configs"][name])
        obj["status"] = body["status"]
        stored = await self.put("configs", obj)
        return _json(stored)


# -- fixtures and helpers --------------------------------------------------------


def gateway_doc(**scheduler: Any) -> dict[str, Any]:
    base = {"name": "llama", "modelName": "llama-3.1-70b", "modelSelector": {}}
    base["modelSelector"] = {"matchLabels": {"app": "vllm-llama"}}
    base.update(scheduler)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "gw", "namespace": NS},
        "spec": {"bbr": {"enabled": True}, "schedulers": [base]},
    }


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    terminating: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "labels": labels or {"app": "vllm-llama"},
    }
    if terminating:
        meta["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        meta["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status,
    }


class FakePicker:
    """The slice of PickerApp discovery uses, with a real Datastore, recording its calls."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.datastore = Datastore(config)
        self.membership_calls: list[str] = []

    def apply_config(self, config: GatewayConfig) -> bool:
        if config.listen_port != self.config.listen_port:
            return False
        self.config = config
        self.datastore.apply_config(config)
        return True

    def membership_changed(self, pool_name: str) -> None:
        self.membership_calls.append(pool_name)

    def members(self, pool: str = "llama") -> list[str]:
        return sorted(self.datastore.pools[pool].members())


async def until(check: Callable[[], bool], timeout: float = 8.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def api():
    server = MockApiServer()
    await server.start()
    yield server
    await server.stop()


def kubeconfig(server: str) -> dict[str, Any]:
    """A kubeconfig like `kubectl` writes, pointing at the mock."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "mock", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "not-checked"}}],
        "contexts": [
            {
                "name": "mock",
                "context": {"cluster": "mock", "user": "tester", "namespace": NS},
            }
        ],
        "current-context": "mock",
    }


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump(kubeconfig(server)))
    return path


async def discovery_for(
    api: MockApiServer, picker: FakePicker, **settings: Any
) -> KubernetesDiscovery:
    client = AsyncClient(config=KubeConfig.from_dict(kubeconfig(api.url)))
    merged = {"enabled": True, "initial_sync_timeout_s": 5.0, **settings}
    discovery = KubernetesDiscovery(
        picker, DiscoverySettings(**merged), client, backoff_base_s=0.02, backoff_max_s=0.2
    )
    await discovery.start()
    return discovery


# -- pure parts ----------------------------------------------------------------------


def test_members_rule_and_formatting():
    pods = [
        PodView("a", "10.0.0.1", ready=True, terminating=False),
        PodView("b", "10.0.0.2", ready=False, terminating=False),
        PodView("c", "10.0.0.3", ready=True, terminating=True),
        PodView("d", None, ready=True, terminating=False),
        PodView("e", "fd00::5", ready=True, terminating=False),
    ]
    assert members(pods, 8000) == ["10.0.0.1:8000", "[fd00::5]:8000"]
    assert endpoint("fd00::5", 1) == "[fd00::5]:1"


def test_settings_from_env():
    assert not DiscoverySettings.from_env({}).enabled
    assert DiscoverySettings.from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).enabled
    off = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "IGW_DISCOVERY": "off"}
    assert not DiscoverySettings.from_env(off).enabled
    s = DiscoverySettings.from_env(
        {
            "IGW_DISCOVERY": "kubernetes",
            "IGW_POD_NAMESPACE": "models",
            "IGW_CONFIG_RESOURCE": "gateways/main",
            "IGW_CONFIG_STATUS": "false",
            "IGW_DISCOVERY_RESYNC": "60",
        }
    )
    assert s.enabled and s.pod_namespace == "models" and not s.write_status
    assert s.config_resource == ConfigResource("main", "gateways") and s.resync_s == 60
    assert ConfigResource.parse("main") == ConfigResource("main", None)
    for bad in (
        {"IGW_DISCOVERY": "maybe"},
        {"IGW_CONFIG_RESOURCE": "a/b/c"},
        {"IGW_POD_NAMESPACE": "Not_A_Namespace"},
        {"IGW_DISCOVERY_RESYNC": "0"},
        {"IGW_CONFIG_STATUS": "perhaps"},
    ):
        with pytest.raises(SettingsError):
            DiscoverySettings.from_env(bad)


async def test_off_outside_a_cluster():
    picker = FakePicker(parse_config(gateway_doc()))
    assert await start_discovery(picker, env={}) is None


def test_server_owned_metadata_is_not_an_unknown_field():
    obj = gateway_doc()
    obj["metadata"].update(
        uid="u",
        generation=3,
        finalizers=["x"],
        ownerReferences=[],
        managedFields=[{"manager": "kubectl"}],
    )
    obj["status"] = {"conditions": []}
    doc = user_document(obj)
    assert doc["metadata"] == {"name": "gw", "namespace": NS}
    assert parse_config(doc).schedulers[0].name == "llama"


# -- against the mock API server -------------------------------------------------


async def test_pods_ready_unready_terminating_deleted(api: MockApiServer, tmp_path, monkeypatch):
    await api.put("pods", pod("a", "10.0.0.1"))
    await api.put("pods", pod("b", "10.0.0.2", ready=False))
    await api.put("pods", pod("other", "10.0.0.9", labels={"app": "something-else"}))
    await api.put("pods", pod("pending", None))
    picker = FakePicker(parse_config(gateway_doc(targetPort=8080)))
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", api.url)))
    discovery = await start_discovery(picker, env={"IGW_DISCOVERY": "kubernetes"})
    assert discovery is not None
    try:
        # start() waits for the first list: members are there when it returns
        assert picker.members() == ["10.0.0.1:8080"]
        assert picker.membership_calls == ["llama"]
        (_, _, query) = next(r for r in api.requests if r[1] == PODS)
        assert query["labelSelector"] == "app=vllm-llama"

        await api.put("pods", pod("b", "10.0.0.2", ready=True))
        await until(lambda: picker.members() == ["10.0.0.1:8080", "10.0.0.2:8080"], what="b")
        await api.put("pods", pod("a", "10.0.0.1", terminating=True))
        await until(lambda: picker.members() == ["10.0.0.2:8080"], what="a terminating")
        await api.put("pods", pod("pending", "10.0.0.3"))
        await until(lambda: "10.0.0.3:8080" in picker.members(), what="pending gets an IP")
        await api.put("pods", pod("b", "10.0.0.2", ready=False))
        await until(lambda: picker.members() == ["10.0.0.3:8080"], what="b unready")
        await api.delete("pods", "pending")
        await api.delete("pods", "a")
        await until(lambda: picker.members() == [], what="deleted")
        # one list, one watch: everything above came as watch events
        assert api.count(PODS, watch=False) == 1
        assert api.count(PODS, watch=True) == 1
    finally:
        await discovery.stop()
    assert not api.open_watches or all(t.is_closing() for t in api.open_watches)


async def test_410_gone_event_forces_a_relist(api: MockApiServer):
    await api.put("pods", pod("a", "10.0.0.1"))
    await api.put("pods", pod("b", "10.0.0.2"))
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker)
    try:
        assert picker.members() == ["10.0.0.1:8000", "10.0.0.2:8000"]
        # changes the open watch never sees, then the history is compacted
        api.hold = True
        await api.delete("pods", "a")
        await api.put("pods", pod("c", "10.0.0.3"))
        await api.expire_watches()
        await until(lambda: api.count(PODS, watch=False) == 2, what="relist")
        # a re-watch would have reported c but never a's deletion; the relist did
        await until(lambda: picker.members() == ["10.0.0.2:8000", "10.0.0.3:8000"])
        api.hold = False
        await api.put("pods", pod("d", "10.0.0.4"))
        await until(lambda: "10.0.0.4:8000" in picker.members(), what="watch after relist")
    finally:
        await discovery.stop()


async def test_http_410_on_resume_forces_a_relist(api: MockApiServer):
    await api.put("pods", pod("a", "10.0.0.1"))
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker)
    try:
        api.hold = True
        api.gone_as_http = True
        await api.delete("pods", "a")
        api.compacted = api.rv
        api.drop_watches()  # lightkube resumes from its version: the server answers HTTP 410
        await until(lambda: api.count(PODS, watch=False) == 2, what="relist after HTTP 410")
        await until(lambda: picker.members() == [], what="a gone")
    finally:
        await discovery.stop()


async def test_dropped_watch_resumes_from_last_version(api: MockApiServer):
    await api.put("pods", pod("a", "10.0.0.1"))
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker)
    try:
        await api.put("pods", pod("b", "10.0.0.2"))
        await until(lambda: len(picker.members()) == 2)
        seen = str(api.rv)
        api.drop_watches()
        await until(lambda: api.count(PODS, watch=True) == 2, what="reconnect")
        watches = [q for _, p, q in api.requests if p == PODS and "watch" in q]
        assert watches[-1]["resourceVersion"] == seen  # resumed, not restarted
        assert api.count(PODS, watch=False) == 1  # no relist needed
        await api.delete("pods", "b")
        await until(lambda: picker.members() == ["10.0.0.1:8000"], what="event after reconnect")
    finally:
        await discovery.stop()


async def test_api_errors_back_off_and_recover(api: MockApiServer, caplog):
    await api.put("pods", pod("a", "10.0.0.1"))
    api.fail_lists = 3
    picker = FakePicker(parse_config(gateway_doc()))
    caplog.set_level(logging.WARNING, "picker.discovery")
    discovery = await discovery_for(api, picker)
    try:
        assert picker.members() == ["10.0.0.1:8000"]
        assert api.count(PODS, watch=False) == 4
        assert "API error 503" in caplog.text
        # the API server going away keeps the last known members
        api.drop_watches()
        api.fail_lists = 1000
        await asyncio.sleep(0.3)
        assert picker.members() == ["10.0.0.1:8000"]
    finally:
        await discovery.stop()


async def test_periodic_resync_relists(api: MockApiServer):
    await api.put("pods", pod("a", "10.0.0.1"))
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker, resync_s=1.0)
    try:
        await until(lambda: api.count(PODS, watch=False) >= 2, timeout=5, what="resync")
        assert picker.members() == ["10.0.0.1:8000"]
    finally:
        await discovery.stop()


async def test_file_config_change_retargets_watches(api: MockApiServer):
    """A config applied by the file reload (not by discovery) is noticed and followed."""
    await api.put("pods", pod("a", "10.0.0.1"))
    await api.put("pods", pod("m", "10.0.1.1", labels={"app": "vllm-mistral"}))
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker)
    try:
        doc = gateway_doc()
        doc["spec"]["schedulers"].append(
            {
                "name": "mistral",
                "modelName": "mistral-7b",
                "modelSelector": {"matchLabels": {"app": "vllm-mistral"}},
            }
        )
        doc["spec"]["schedulers"][0]["targetPort"] = 9000
        assert picker.apply_config(parse_config(doc))
        await until(lambda: picker.members("mistral") == ["10.0.1.1:8000"], what="new pool")
        await until(lambda: picker.members() == ["10.0.0.1:9000"], what="new targetPort")
        # static endpoints replace the selector: its watch stops
        doc["spec"]["schedulers"][1] = {
            "name": "mistral",
            "modelName": "mistral-7b",
            "endpoints": ["127.0.0.1:7000"],
        }
        assert picker.apply_config(parse_config(doc))
        await until(lambda: len(discovery._pod_watches) == 1, what="watch stopped")
        await api.put("pods", pod("m2", "10.0.1.2", labels={"app": "vllm-mistral"}))
        await asyncio.sleep(0.2)
        assert picker.members("mistral") == ["127.0.0.1:7000"]
    finally:
        await discovery.stop()


async def test_config_resource_applies_and_refuses(api: MockApiServer):
    await api.put("pods", pod("a", "10.0.0.1"))
    await api.put("pods", pod("s", "10.0.2.1", labels={"app": "sglang-qwen"}))
    cr = gateway_doc(weights={"queue": 5, "kvCache": 1})
    await api.put("configs", cr)
    await api.put("configs", {**gateway_doc(), "metadata": {"name": "other", "namespace": NS}})
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(api, picker, config_resource=ConfigResource("gw", NS))
    try:
        # applied before start() returned: weights from the resource, status Accepted
        assert picker.config.schedulers[0].weights == {"queue": 5.0, "kvCache": 1.0}
        assert picker.members() == ["10.0.0.1:8000"]
        cr_lists = [q for m, p, q in api.requests if p == CRS and "watch" not in q]
        assert cr_lists[0]["fieldSelector"] == "metadata.name=gw"
        await until(lambda: len(api.patches) == 1, what="status")
        condition = api.patches[0]["status"]["conditions"][0]
        assert (condition["type"], condition["status"], condition["reason"]) == (
            "Accepted",
            "True",
            "Applied",
        )
        assert api.patches[0]["status"]["observedGeneration"] == 1
        assert api.patches[0]["status"]["pools"] == 1

        # a new scheduler with its own selector: applied, a new watch feeds it
        new = copy.deepcopy(cr)
        new["spec"]["schedulers"].append(
            {
                "name": "qwen",
                "modelName": "qwen-2.5",
                "engineType": "sglang",
                "modelSelector": {"matchLabels": {"app": "sglang-qwen"}},
            }
        )
        await api.put("configs", new)
        await until(lambda: "qwen" in picker.datastore.pools, what="new scheduler")
        await until(lambda: picker.members("qwen") == ["10.0.2.1:8000"], what="qwen members")
        await until(lambda: len(api.patches) == 2)
        assert api.patches[1]["status"]["observedGeneration"] == 2
        assert api.patches[1]["status"]["pools"] == 2

        # invalid: refused, running config kept, status says which field
        bad = copy.deepcopy(new)
        bad["spec"]["schedulers"][1]["scheduler"] = "fastest"
        before = picker.config
        await api.put("configs", bad)
        await until(lambda: len(api.patches) == 3, what="status of the invalid one")
        assert picker.config is before
        condition = api.patches[2]["status"]["conditions"][0]
        assert condition["status"] == "False" and condition["reason"] == "Invalid"
        assert "spec.schedulers[1].scheduler" in condition["message"]
        assert api.patches[2]["status"]["pools"] == 2  # what is still being served

        # valid but needing a restart: refused by the picker, status NotApplied
        restart = copy.deepcopy(new)
        restart["spec"]["listener"] = {"port": 9443}
        await api.put("configs", restart)
        await until(lambda: len(api.patches) == 4)
        assert api.patches[3]["status"]["conditions"][0]["reason"] == "NotApplied"
        assert picker.config is before

        # status writes (MODIFIED events with the same spec) never loop
        await asyncio.sleep(0.3)
        assert len(api.patches) == 4
        # the other resource in the namespace is never read
        assert picker.config.schedulers[0].weights == {"queue": 5.0, "kvCache": 1.0}

        # deleted: the running config stays
        await api.delete("configs", "gw")
        await asyncio.sleep(0.2)
        assert picker.config is before and "qwen" in picker.datastore.pools
    finally:
        await discovery.stop()


async def test_config_resource_absent_then_created(api: MockApiServer):
    picker = FakePicker(parse_config(gateway_doc()))
    discovery = await discovery_for(
        api, picker, config_resource=ConfigResource("gw"), write_status=False
    )
    try:
        assert picker.config.schedulers[0].weights == {}
        await api.put("configs", gateway_doc(weights={"prefix": 7}))
        await until(lambda: picker.config.schedulers[0].weights == {"prefix": 7.0})
        assert api.patches == []
    finally:
        await discovery.stop()


async def test_picker_app_hook(api: MockApiServer, tmp_path, monkeypatch):
    """The real PickerApp: start() starts discovery, members reach the EDS files, stop() ends it."""
    app_module = pytest.importorskip("picker.app", exc_type=ImportError)
    from igw.ports import free_ports

    ports = free_ports(4)
    doc = gateway_doc()
    names = ("picker", "admin", "metrics", "envoyAdmin")
    doc["spec"]["ports"] = dict(zip(names, ports, strict=True))
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    await api.put("pods", pod("a", "10.0.0.1"))
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", api.url)))
    monkeypatch.setenv("IGW_DISCOVERY", "kubernetes")
    app = app_module.PickerApp(config_path, tmp_path / "state")
    await app.start()
    try:
        eds = json.loads((app.eds_dir / "pool_llama.json").read_text())
        sock = eds["resources"][0]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert sock["socket_address"] == {"address": "10.0.0.1", "port_value": 8000}
    finally:
        await app.stop(drain_timeout=0.1)
    assert all(t.done() for t in asyncio.all_tasks() if t.get_name().startswith("igw-pods"))
