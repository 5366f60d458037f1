"""`jaxsmol serve`: an OpenAI-compatible HTTP daemon (and Anthropic's Messages API, cli/server/messages.py)
that keeps the prefix cache across requests.

FastAPI validates requests (models in cli/api/protocol.py); uvicorn serves them. `Daemon` holds the
engine, cache, worker, metrics and API keys, with one method per route: a handler turns a request
into a `Job` (cli/api/events.py), submits it to the worker thread (cli/server/worker.py) and relays its events
as one JSON body or as server-sent events (shapes in cli/api/responses.py). Tokenizing, chat templates,
prompt checks and logprob JSON run off the event loop (`asyncio.to_thread`).
With `cache_dir`, the prefix cache has a second tier on disk (cache/store/disk.py): warmed from it before
the first request, written to it at shutdown (and on eviction). Readiness: /health and /ready answer
503 {"status": "warming"} until the programs are compiled (cli/server/warmup.py, `--warmup`), then 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.server.access_log import AccessLog, log_to_stderr, record
from jaxsmol.cli.server.cache_routes import CacheRoutes, install_cache_routes
from jaxsmol.cli.server.cached_contents import CachedContents, install_cached_contents_routes
from jaxsmol.cli.server.completions import Completions
from jaxsmol.cli.api.events import DEFAULT_WRITE_TIMEOUT_S
from jaxsmol.cli.server.limits import (DEFAULT_READ_TIMEOUT_S, RequestLimits, error_response,
                                      read_timeout_protocol)
from jaxsmol.cli.server.messages import Messages, install_messages_routes
from jaxsmol.cli.server.memory import MemoryAccount
from jaxsmol.cli.server.replica import model_info, read_load, server_info
from jaxsmol.cli.server.responses_route import Responses, install_responses_routes
from jaxsmol.cli.server.metrics import Metrics
from jaxsmol.cli.server.tenants import Tenants
from jaxsmol.cli.server.warmup import Warmup
from jaxsmol.cli.server.worker import Worker
from jaxsmol.errors import JaxsmolError

ROUTES = ("/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/cache/flush",
          "/tokenize", "/detokenize", "/v1/cache", "/v1/cache/pin", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/responses", "/v1/cached_contents")
# what a router in front of several daemons calls (cli/server/replica.py): SGLang's names
REPLICA_ROUTES = ("/get_load", "/flush_cache", "/server_info", "/get_server_info", "/model_info", "/get_model_info")


class Daemon:
    """The daemon's state and its routes (one method each); `create_app` wires them to FastAPI."""

    def __init__(self, engine, cache: PrefixCache, worker: Worker, metrics: Metrics, tenants: Tenants,
                 model_name: str, write_timeout_s: float, warmup: str = "none"):
        self.engine, self.cache, self.worker, self.metrics = engine, cache, worker, metrics
        self.tenants, self.model_name = tenants, model_name
        self.warmup = Warmup(warmup, self.worker.scheduler)
        self.runner = Completions(engine, worker, metrics, model_name, write_timeout_s)
        self.memory = MemoryAccount(engine.params, worker.draft.engine.params if worker.draft else None)

    def _auth(self, request: Request, admin: bool = False):
        tenant = self.tenants.authenticate(request.headers.get("authorization"), admin=admin,
                                           api_key=request.headers.get("x-api-key"))
        record(request).note_tenant(tenant.namespace)
        return tenant

    # ---- lifespan --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        cache, worker = self.cache, self.worker
        self.memory.start(pool=self.engine.pool_bytes, batch_kv=self.worker.scheduler.kv_bytes_held)
        if cache.disk is not None:
            n = await asyncio.to_thread(cache.warm_from_disk)
            print(f"prefix cache: {n} entries loaded from {cache.disk.dir} ({cache.pins.restored} pinned)",
                  file=sys.stderr, flush=True)
            for warning in cache.pins.warnings:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        worker.start()
        self.warmup.start()  # background mode only: block has run, none runs nothing
        yield
        worker.stop()  # queued jobs finish first (SIGTERM drains)
        await asyncio.to_thread(worker.join, 120)
        await asyncio.to_thread(self.warmup.close, 120)
        if cache.disk is not None:
            n = await asyncio.to_thread(self._locked, cache.persist_to_disk)
            print(f"prefix cache: {n} entries on disk in {cache.disk.dir}", file=sys.stderr, flush=True)
        if cache.shared is not None and cache.shared.write_back:
            n = await asyncio.to_thread(self._locked, cache.persist_to_shared)
            print(f"prefix cache: {n} chunks written back to the shared cache", file=sys.stderr, flush=True)

    def _locked(self, fn):
        with self.worker.lock:  # not while a request is using the model or the cache
            return fn()

    # ---- routes ----------------------------------------------------------------------------------
    async def health(self):
        """GET /health and GET /ready, for load balancers and routers (a startupProbe, a readinessProbe):
        200 {"status": "ok"} when ready, 503 {"status": "warming"} while the programs compile (a daemon
        that answers at all is alive), with the model's name and the load."""
        state = self.warmup.state()
        body = {"status": "ok" if state["ready"] else "warming", "model": self.model_name, "busy": self.worker.busy,
                "queued": self.worker.jobs.qsize(), "compiling": not state["ready"], **state}
        return JSONResponse(body, status_code=200 if state["ready"] else 503)

    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxsmol", "max_model_len": self.engine.ctx}]}

    async def prometheus(self, request: Request):
        self._auth(request, admin=True)
        stats, batch, pool = self.cache.stats.as_dict(), self.worker.scheduler.figures(), self.engine.pool_bytes
        stats["fetched_bytes"] = self.cache.fetcher.nbytes  # read ahead for waiting requests (cache/fetch.py)
        stats["disk_queued_bytes"] = self.cache.disk.queued_bytes if self.cache.disk is not None else 0
        held = stats["bytes_held"] + stats["fetched_bytes"] + stats["disk_queued_bytes"]
        memory = self.memory.figures(held + batch.get("draft_cache_bytes", 0), pool,
                                     batch.get("kv_bytes", 0), arena_span=self.worker.scheduler.arena_span,
                                     programs_after_ready=self.warmup.programs_after_ready())
        load = read_load(self.worker, self.engine.kv_bytes_per_token)
        text = self.metrics.render(stats, self.worker.jobs.qsize(), batch, pool, memory, load=load)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def flush(self, request: Request):
        self._auth(request, admin=True)
        await asyncio.to_thread(self._locked, self.cache.flush)
        if self.worker.draft is not None:  # the draft model's prompt states too
            await asyncio.to_thread(self._locked, self.worker.draft.cache.flush)
        return {"flushed": True}

    async def load(self):
        """SGLang's GET /get_load (no key needed, as /health): running and waiting requests, tokens."""
        return JSONResponse(read_load(self.worker, self.engine.kv_bytes_per_token).sglang())

    async def server_info(self):
        return server_info(self.engine, self.model_name, self.worker.scheduler.max_batch)

    async def model_info(self):
        return model_info(self.engine, self.model_name)

    async def tokenize(self, body: P.TokenizeRequest, request: Request):
        self._auth(request)
        if (body.prompt is None) == (body.messages is None):
            raise P.ProtocolError("give either prompt or messages", param="prompt")
        ids = await asyncio.to_thread(self.runner.tokenize, body)
        out = {"count": len(ids), "max_model_len": self.engine.ctx, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await asyncio.to_thread(lambda: [self.runner.decode_one(i) for i in ids])
        return out

    async def detokenize(self, body: P.DetokenizeRequest, request: Request):
        self._auth(request)
        return {"prompt": await asyncio.to_thread(self.engine.tokenizer.decode, body.tokens)}

    async def completions(self, body: P.CompletionRequest, request: Request):
        tenant = self._auth(request)
        P.refuse_unsupported(body)
        if body.stream and (body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)):
            raise P.ProtocolError("stream: prompt log-probabilities (echo with logprobs, prompt_logprobs) are "
                                  "not streamed; send the request without stream", param="stream")
        start = await self._cached_content(tenant, body)
        specs, view = await asyncio.to_thread(self.runner.completion_plan, body, start)
        salt = P.request_salt(body, None if start is None else start.cache_salt)
        return await self.runner.answer(request, body, tenant, specs, view, salt)

    async def chat(self, body: P.ChatRequest, request: Request):
        tenant = self._auth(request)
        P.refuse_unsupported(body)
        start = await self._cached_content(tenant, body)
        specs, view = await asyncio.to_thread(self.runner.chat_plan, body, start)
        salt = P.request_salt(body, None if start is None else start.cache_salt)
        return await self.runner.answer(request, body, tenant, specs, view, salt)

    async def _cached_content(self, tenant, body):
        """The tenant's cached content the request names (None if it names none); a 400 naming the
        field for one that does not exist (or is another tenant's, or has expired)."""
        if body.cached_content is None:
            return None
        found = await asyncio.to_thread(self._locked, lambda: self.cache.named.get(body.cached_content,
                                                                                   tenant.namespace))
        if found is None:
            raise P.ProtocolError(f"cached_content: no cached content {body.cached_content!r} (expired, deleted, "
                                  "or never made)", param="cached_content")
        return found


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        path = request.url.path
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", path=path)
        if not where and err.get("type") in ("model_attributes_type", "dict_type"):
            return error_response(400, "the request body must be a JSON object", path=path)
        return error_response(400, f"{where or 'body'}: {err.get('msg', 'invalid request')}", param=where or None,
                              path=path)

    @app.exception_handler(P.ProtocolError)
    async def _protocol(request: Request, exc: P.ProtocolError):
        return error_response(exc.status, exc.message, type_=exc.type, param=exc.param, headers=exc.headers,
                              path=request.url.path)

    @app.exception_handler(JaxsmolError)
    async def _user_error(request: Request, exc: JaxsmolError):
        return error_response(400, str(exc), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), type_=kind, headers=exc.headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error",
                              path=request.url.path)


def create_app(engine, *, cache_bytes: int = 2 << 30, prefix_cache: bool = True, max_queue: int = 64,
               model_name: str | None = None, cache_mode: str = "radix", cache_dir=None,
               disk_cache_bytes: int = 4 << 30, tenants: Tenants | None = None,
               write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, batch: BatchSettings = BatchSettings(),
               warmup: str = "none", pinned_bytes: int = 512 << 20, draft=None, access_log: bool = True,
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, shared=None) -> FastAPI:
    """The daemon's app. access_log: a line per request (cli/server/access_log.py); read_timeout_s:
    a request body that stalls this long is answered 408 (its headers' timeout is the HTTP protocol's:
    `serve`); shared: the prefix cache's shared tier (cache/store/shared.py SharedStore), or None."""
    disk = None
    if cache_dir is not None and prefix_cache:
        from jaxsmol.cache.store.disk import DiskStore, identity

        disk = DiskStore(cache_dir, identity(engine), disk_cache_bytes, background=True)
        for name, reason in disk.skipped:
            print(f"warning: cache file {name} not used: {reason}", file=sys.stderr, flush=True)
    cache = PrefixCache(engine, mode=cache_mode if prefix_cache else "off", budget_bytes=cache_bytes, disk=disk,
                        pinned_bytes=pinned_bytes, shared=shared)
    metrics = Metrics(ROUTES + REPLICA_ROUTES)
    worker = Worker(cache, max_queue, metrics, batch, draft)
    model_name = model_name or engine.name
    d = Daemon(engine, cache, worker, metrics, tenants or Tenants(), model_name, write_timeout_s, warmup)

    app = FastAPI(title="jaxsmol", docs_url=None, redoc_url=None, lifespan=d.lifespan)
    app.state.daemon, app.state.cache, app.state.worker, app.state.metrics = d, cache, worker, metrics
    app.add_middleware(RequestLimits, metrics=metrics, read_timeout_s=read_timeout_s)
    if access_log:
        app.add_middleware(AccessLog)  # the outer one: it sees the limits' answers too
    _install_error_handlers(app)
    app.get("/health")(d.health)
    app.get("/ready")(d.health)
    app.get("/v1/models")(d.models)
    app.get("/metrics")(d.prometheus)
    app.post("/v1/cache/flush")(d.flush)
    app.post("/flush_cache")(d.flush)  # SGLang's name, which sglang-router calls on every worker
    install_cache_routes(app, CacheRoutes(d.runner, cache, d._auth, d._locked))  # pins, GET /v1/cache
    app.get("/get_load")(d.load)
    for path in ("/server_info", "/get_server_info"):
        app.get(path)(d.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path)(d.model_info)
    app.post("/tokenize")(d.tokenize)
    app.post("/detokenize")(d.detokenize)
    app.post("/v1/completions")(d.completions)
    app.post("/v1/chat/completions")(d.chat)
    messages = Messages(d.runner, d._auth)
    install_messages_routes(app, messages)  # Anthropic's Messages API
    # Gemini's cached contents: named prefixes, their TTLs scaled by the Messages API's test hook
    install_cached_contents_routes(app, CachedContents(d.runner, cache, d._auth, d._locked, messages.ttl_scale))
    install_responses_routes(app, Responses(d.runner, d._auth))  # OpenAI's Responses API
    return app


def serve(engine, host: str, port: int, max_connections: int | None = None,
          read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, **kw) -> None:
    """Serve `create_app(engine, **kw)` on host:port until SIGTERM. read_timeout_s: a request whose
    headers, or a part of its body, do not arrive within it is answered 408 (cli/server/limits.py)."""
    import uvicorn

    log_to_stderr()
    app = create_app(engine, read_timeout_s=read_timeout_s, **kw)
    if app.state.daemon.warmup.mode == "block":
        app.state.daemon.warmup.run()  # the port opens ready
    print(f"jaxsmol serving {app.state.daemon.model_name} ({engine.source}) on http://{host}:{port}", file=sys.stderr,
          flush=True)
    # uvicorn drains on SIGTERM, then raises the signal again once it has restored the previous handler:
    # with the default handler that kills the drained process (exit status -15). A drained stop is a clean exit.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, **uvicorn_options(app, host, port, max_connections, read_timeout_s))
    finally:
        signal.signal(signal.SIGTERM, previous)


def uvicorn_options(app, host: str, port: int, max_connections: int | None = None,
                    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> dict:
    """uvicorn's settings for the daemon's app: its own access log (access_log.AccessLog) and HTTP
    protocol (limits.ReadTimeoutProtocol), a drain of up to 120 s on SIGTERM."""
    return {"host": host, "port": port, "log_level": "warning", "timeout_graceful_shutdown": 120,
            "limit_concurrency": max_connections, "access_log": False,
            "http": read_timeout_protocol(read_timeout_s, app.state.metrics)}
