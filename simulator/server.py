"""One simulated pod on its own port: the OpenAI API, /health, /metrics and the admin API.

The HTTP layer only translates: it validates a request, hands it to the engine and streams
whatever tokens the engine has produced since it last looked. Faults are applied here, at the
edge, because that is where a client sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from simulator import metrics_text, openai_format
from simulator.engine import (
    Engine,
    PromptTooLong,
    QueueFull,
    SimRequest,
    finish_reason,
)
from simulator.faults import FaultError, FaultState
from simulator.spec import PodSpec
from simulator.tokens import (
    VOCAB,
    PromptError,
    block_hashes,
    chat_prompt_text,
    completion_prompt_text,
    count_tokens,
    word_ids,
    word_offset,
)

DEFAULT_MAX_TOKENS = 128
HANG_LIMIT_S = 600.0  # a hung request is answered 504 after this long, never held forever
REQUEST_LIMIT_S = 3600.0  # wall-time bound on one request once queued (slow or stuck client)
SHUTDOWN_TIMEOUT_S = 1.0
CRASH_DELAY_S = 0.02  # lets the admin response that asked for a crash reach its client
MAX_BODY_BYTES = 16 * 1024 * 1024
POD_HEADER = "x-sim-pod"


class BadRequest(Exception):
    """A request the pod refuses with 400 in vLLM's error shape."""


def build_request(body: dict[str, Any], model: str, base_model: str,
                  chat: bool) -> tuple[SimRequest, str]:
    """The engine request for a parsed OpenAI body (and its prompt text); shared with
    bench/replay.py so a replay meets exactly the prompts a live pod would."""
    text = chat_prompt_text(body.get("messages")) if chat else completion_prompt_text(
        body.get("prompt"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    explicit = max_tokens is not None
    if not explicit:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens must be an integer >= 1")
    req = SimRequest(
        model=model,
        adapter=model if model != base_model else None,
        prompt_tokens=count_tokens(text),
        hashes=block_hashes(text, model),
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        explicit_max=explicit,
    )
    return req, text


class PodServer:
    """A pod: engine + faults + the aiohttp listener that serves them.

    ``start`` builds a fresh engine and opens the listener; ``crash`` closes the listener and
    drops every connection and request in flight; ``restart`` is ``start`` again on the same
    port with no faults.
    """

    def __init__(self, spec: PodSpec, seed: int = 0, time_scale: float = 1.0,
                 on_crash: Callable[[PodServer], None] | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.seed = seed
        self.time_scale = time_scale
        self.on_crash = on_crash
        self.profile = spec.build_profile()
        self.port = spec.port
        self.up = False
        self._crashed = False
        self.faults = FaultState()
        self.engine = self._new_engine()
        self._served = {spec.model, *spec.lora_adapters}
        self._rng = random.Random(f"{seed}:{spec.name}")
        self._ids = itertools.count()
        self._released = asyncio.Event()
        self._released.set()
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.get_load_calls = 0  # how often a router polled /get_load (benchmarks check it)
        self._page_options = spec.page_options()
        self._started_at = time.time()  # the `_created` value of vLLM's counters

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def url(self) -> str:
        """http://host:port of the pod (the OpenAI base URL is url + "/v1")."""
        return f"http://{self.host}:{self.port}"

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self, faults: dict[str, Any] | None = None) -> None:
        """Fresh engine, faults set to ``faults`` (default: the spec's start-up faults), and
        the listener opened unless those faults include a crash."""
        await self.engine.stop()  # the previous incarnation's loop, if any
        self.engine = self._new_engine()
        self._started_at = time.time()
        self._crashed = False
        self.faults = FaultState()
        self.set_faults(self.spec.faults if faults is None else faults, at_start=True)
        if self.faults.crash:  # crashed from the start: no engine loop, no listener
            return
        self.engine.start()
        await self._listen()

    async def stop(self) -> None:
        await self.engine.stop()
        self._released.set()
        await self._close_listener(abort=False)
        self.up = False

    async def crash(self) -> None:
        """Close the listener and drop every connection, as a dead process would."""
        self._crashed = True
        self.faults.crash = True
        if self.up:
            self.up = False
            await self._close_listener(abort=True)
        await self.engine.stop()
        self._released.set()
        if self.on_crash is not None:
            self.on_crash(self)

    async def restart(self) -> None:
        """Bring a crashed (or running) pod back: same port, fresh engine, no faults."""
        if self.up:
            await self.stop()
        await self.start(faults={})

    def set_faults(self, changes: Any, at_start: bool = False) -> None:
        """Apply a partial fault update (raises FaultError when invalid)."""
        self.faults.update(changes)
        self.faults.crash = self.faults.crash or self._crashed  # only a restart revives
        self.engine.slowdown = self.faults.slowdown
        if self.faults.hang:
            self._released.clear()
        else:
            self._released.set()
        if self.faults.crash and self.up and not at_start:
            self._spawn(self._crash_soon())

    def clear_faults(self) -> None:
        """Back to no faults (a crashed pod stays down until restarted)."""
        self.faults = FaultState()
        self.set_faults({})

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.spec.engine, "gpu": self.spec.gpu,
                "host": self.host, "port": self.port, "up": self.up,
                "faults": self.faults.as_dict(), "get_load_calls": self.get_load_calls,
                **self.engine.state()}

    def _new_engine(self) -> Engine:
        return Engine(self.spec.engine_config(self.profile, self.time_scale))

    async def _listen(self) -> None:
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        self.up = True

    async def _close_listener(self, abort: bool) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if abort and runner.server is not None:
            for site in list(runner.sites):
                await site.stop()
            for conn in list(runner.server.connections):
                conn.force_close()
                if conn.transport is not None:
                    conn.transport.abort()
        await runner.cleanup()

    async def _crash_soon(self) -> None:
        await asyncio.sleep(CRASH_DELAY_S)
        await self.crash()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- HTTP app --------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(self._tag_response)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        if self.spec.engine == "sglang":
            app.router.add_get("/get_load", self._get_load)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_post("/admin/faults", self._post_faults)
        app.router.add_delete("/admin/faults", self._delete_faults)
        app.router.add_get("/admin/state", self._get_state)
        app.router.add_get("/admin/lateness", self._get_lateness)
        return app

    async def _tag_response(self, _request: web.Request, response: web.StreamResponse) -> None:
        response.headers[POD_HEADER] = self.name

    async def _hang_if_asked(self) -> None:
        if self._released.is_set():
            return
        try:
            await asyncio.wait_for(self._released.wait(), HANG_LIMIT_S)
        except TimeoutError:
            raise web.HTTPGatewayTimeout() from None

    async def _health(self, _request: web.Request) -> web.Response:
        await self._hang_if_asked()
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        await self._hang_if_asked()
        mode = self.faults.metrics
        if mode == "down":
            return web.Response(status=503, text="metrics unavailable")
        if mode == "closed":
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError
        body = metrics_text.GARBLED if mode == "garbled" else metrics_text.render(
            self.engine, self.spec.engine, self._page_options, self._started_at,
            self.engine.now())
        return web.Response(body=body, headers={"Content-Type": metrics_text.CONTENT_TYPE})

    async def _get_load(self, _request: web.Request) -> web.Response:
        """SGLang's load endpoint, which sglang-router's power_of_two policy polls."""
        await self._hang_if_asked()
        self.get_load_calls += 1
        return _json(orjson.dumps(sglang_load(self.engine)))

    async def _models(self, _request: web.Request) -> web.Response:
        await self._hang_if_asked()
        body = openai_format.models_body(self.spec.model, list(self.spec.lora_adapters),
                                         int(time.time()), self.profile.max_model_len)
        return _json(body)

    async def _get_faults(self, _request: web.Request) -> web.Response:
        return _json(orjson.dumps(self.faults.as_dict()))

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            self.set_faults(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, FaultError) as e:
            return _error(400, str(e), "BadRequestError")
        return _json(orjson.dumps(self.faults.as_dict()))

    async def _delete_faults(self, _request: web.Request) -> web.Response:
        self.clear_faults()
        return _json(orjson.dumps(self.faults.as_dict()))

    async def _get_state(self, _request: web.Request) -> web.Response:
        return _json(orjson.dumps(self.state()))

    async def _get_lateness(self, _request: web.Request) -> web.Response:
        """Every recent lateness sample (ms), for benchmarks that pool them across pods."""
        return _json(orjson.dumps(list(self.engine.stats.lateness_ms)))

    # ----- inference -------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def _infer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        await self._hang_if_asked()
        status = self.faults.failure_status(self._rng)
        if status is not None:
            return _error(status, "simulated fault", "InternalServerError"
                          if status == 500 else "ServiceUnavailableError")
        try:
            body = _parse_body(await request.read())
            model = body.get("model") or self.spec.model
            if not isinstance(model, str):
                raise BadRequest("'model' must be a string")
            if model not in self._served:
                return _json(openai_format.model_not_found(model), status=404)
            req, text = build_request(body, model, self.spec.model, chat)
            self.engine.submit(req)
        except (BadRequest, PromptError, PromptTooLong) as e:
            return _error(400, str(e), "BadRequestError")
        except QueueFull as e:
            return _error(503, str(e), "ServiceUnavailableError")
        try:
            offset = word_offset(text, self.seed)
            if req.stream:
                return await self._stream(request, req, body, chat, model, offset)
            return await self._respond(req, chat, model, offset)
        finally:
            self.engine.abort(req)  # no-op unless the client left before the end

    async def _stream(self, request: web.Request, req: SimRequest, body: dict[str, Any],
                      chat: bool, model: str, offset: int) -> web.StreamResponse:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        fmt = openai_format.StreamFormat(chat, self._request_id(chat), model, int(time.time()),
                                         include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        # Client gone, pod crashed, or a client that stopped reading held us past the bound.
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            async with asyncio.timeout(REQUEST_LIMIT_S):
                await self._write_tokens(resp, req, fmt, offset)
        return resp

    async def _write_tokens(self, resp: web.StreamResponse, req: SimRequest,
                            fmt: openai_format.StreamFormat, offset: int) -> None:
        sent = 0
        while True:
            produced = req.generated
            if produced > sent:
                data = fmt.tokens(word_ids(offset, sent, produced))
                if sent == 0:
                    data = fmt.role_chunk() + data
                    self.engine.record_lateness(req.first_token_at)
                await resp.write(data)
                sent = produced
            if req.finished:
                break
            await req.progress()
        if req.error is None:
            usage = openai_format.usage(req.prompt_tokens, req.generated, req.cached_tokens)
            await resp.write(fmt.finish(finish_reason(req), usage))
            await resp.write_eof()

    async def _respond(self, req: SimRequest, chat: bool, model: str,
                       offset: int) -> web.Response:
        try:
            async with asyncio.timeout(REQUEST_LIMIT_S):
                while not req.finished:
                    await req.progress()
        except TimeoutError:
            return _error(504, "request took too long", "TimeoutError")
        if req.error is not None:
            return _error(503, req.error, "ServiceUnavailableError")
        self.engine.record_lateness(req.finished_at)
        text = "".join(VOCAB[i] for i in word_ids(offset, 0, req.generated))
        usage = openai_format.usage(req.prompt_tokens, req.generated, req.cached_tokens)
        return _json(openai_format.completion_body(
            chat, self._request_id(chat), model, int(time.time()), text, finish_reason(req),
            usage))

    def _request_id(self, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{next(self._ids)}"


def sglang_load(engine: Engine) -> list[dict[str, Any]]:
    """The body of SGLang's `GET /get_load`: one object per data-parallel rank (one here).

    Source: sgl-project/sglang python/sglang/srt/entrypoints/http_server.py@0025436eab05
    (`get_load` returns `tokenizer_manager.get_load()`, the list of every scheduler's
    `GetLoadReqOutput`); the dataclass (managers/io_struct.py) is `BaseReq` (`rid`,
    `http_worker_ipc`, both null here) plus `dp_rank`, `num_reqs`, `num_waiting_reqs`,
    `num_tokens`, and the scheduler fills it with running + waiting requests, waiting
    requests, and KV tokens in use plus the prompt tokens of the waiting queue. A real page
    of that shape is quoted in sgl-project/sglang PR #13203. The simulator counts KV tokens
    in whole blocks (referenced blocks x block size). sglang-router reads only `num_tokens`,
    summed over the list (sgl-model-gateway/src/core/worker_manager.rs@00a4cf3bd23e,
    `get_worker_load`).
    """
    waiting = engine.waiting
    kv_tokens = engine.kv.used_blocks * engine.profile.block_size
    return [{
        "rid": None,
        "http_worker_ipc": None,
        "dp_rank": 0,
        "num_reqs": len(engine.running) + len(waiting),
        "num_waiting_reqs": len(waiting),
        "num_tokens": kv_tokens + sum(req.prompt_tokens for req in waiting),
    }]


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def _error(status: int, message: str, err_type: str) -> web.Response:
    return _json(openai_format.error_body(message, err_type, status), status=status)

