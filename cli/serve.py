"""`jaxsmol serve`: an OpenAI-compatible HTTP daemon that keeps the prefix cache across requests.

FastAPI validates requests; uvicorn serves them. One worker thread runs the model (cli/worker.py);
handlers enqueue a job and relay its tokens, as one JSON body or as server-sent events.
With `cache_dir`, the prefix cache has a second tier on disk (cache/disk.py): warmed from it before
the first request, written to it at shutdown (and on eviction).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from typing import Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from cache.prefix_cache import PrefixCache
from cli.metrics import Metrics
from cli.worker import Job, QueueFull, Worker
from jaxsmol.errors import JaxsmolError
from jaxsmol.sampling import SamplingParams

MAX_N = 8
MAX_BODY_BYTES = 4 << 20
RETRY_AFTER_S = 1


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # the sampler takes it as an int32 (>= vocab = off)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict | None = None
    cache_salt: str | None = Field(default=None, max_length=256)  # tenants never share cache entries
    use_prefix_cache: bool = True  # false: this request bypasses the cache
    return_token_ids: bool = False  # add `token_ids` (generated ids) to each choice, as vLLM does


class CompletionRequest(_Common):
    prompt: Union[str, list[StrictInt]]  # StrictInt: true/false are not token ids
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None,
                   headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status, headers=headers)


class _LimitsAndCounts:
    """ASGI middleware: counts requests by endpoint and status, and refuses bodies over `limit` bytes
    with 413: at once from the Content-Length, else (a chunked body) when the read passes the limit.

    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) hides the
    client's disconnect from `Request.is_disconnected()`, which the handlers rely on to cancel jobs.
    """

    def __init__(self, app, limit: int, metrics: Metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, seen = 500, 0  # 500 if the app raises before it answers (the error middleware sends it)

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, f"request body over {self.limit} bytes")
            return message

        length = dict(scope["headers"]).get(b"content-length")
        try:
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                await error_response(413, f"request body over {self.limit} bytes")(scope, receive, counted_send)
            else:
                await self.app(scope, limited_receive, counted_send)
        finally:
            self.metrics.request(scope["path"], status)


def create_app(engine, *, cache_bytes: int = 2 << 30, prefix_cache: bool = True, max_queue: int = 64,
               model_name: str | None = None, cache_mode: str = "radix", cache_dir=None,
               disk_cache_bytes: int = 4 << 30) -> FastAPI:
    disk = None
    if cache_dir is not None and prefix_cache:
        from cache.disk import DiskStore, identity

        disk = DiskStore(cache_dir, identity(engine), disk_cache_bytes)
        for name, reason in disk.skipped:
            print(f"warning: cache file {name} not used: {reason}", file=sys.stderr, flush=True)
    cache = PrefixCache(engine, mode=cache_mode if prefix_cache else "off", budget_bytes=cache_bytes, disk=disk)
    metrics = Metrics()
    worker = Worker(cache, max_queue, metrics)
    model_name = model_name or (engine.model_dir.name if engine.model_dir else "jaxsmol")
    default_max_tokens = 16

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        if cache.disk is not None:
            n = await loop.run_in_executor(None, cache.warm_from_disk)
            print(f"prefix cache: {n} entries loaded from {cache.disk.dir}", file=sys.stderr, flush=True)
        worker.start()
        yield
        worker.stop()  # queued jobs finish first (SIGTERM drains)
        await loop.run_in_executor(None, worker.join, 120)
        if cache.disk is not None:
            def _persist():
                with worker.lock:
                    return cache.persist_to_disk()
            n = await loop.run_in_executor(None, _persist)
            print(f"prefix cache: {n} entries on disk in {cache.disk.dir}", file=sys.stderr, flush=True)

    app = FastAPI(title="jaxsmol", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.cache, app.state.worker, app.state.metrics = cache, worker, metrics

    app.add_middleware(_LimitsAndCounts, limit=MAX_BODY_BYTES, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        if not where and err.get("type") in ("model_attributes_type", "dict_type"):
            return error_response(400, "the request body must be a JSON object")
        return error_response(400, f"{where or 'body'}: {err.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), type_=kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")

    # ---- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "busy": worker.busy, "queued": worker.jobs.qsize()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxsmol", "max_model_len": engine.ctx}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(cache.stats.as_dict(), worker.jobs.qsize()),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/cache/flush")
    async def flush():
        loop = asyncio.get_running_loop()

        def _flush():
            with worker.lock:  # not while a request is using the cache
                cache.flush()
        await loop.run_in_executor(None, _flush)
        return {"flushed": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            if body.prompt == "":
                return error_response(400, "prompt: the prompt is empty", param="prompt")
            # tokenizing a long text takes a while: off the event loop, so other requests go on
            ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt)
        else:
            ids = body.prompt
        return await _serve(request, body, ids, chat=False, max_tokens=body.max_tokens,
                            logprobs=body.logprobs or 0)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        text = engine.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        ids = await asyncio.to_thread(engine.tokenizer.encode, text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        k = (body.top_logprobs or 1) if body.logprobs else 0
        return await _serve(request, body, ids, chat=True, max_tokens=max_tokens, logprobs=k)

    async def _serve(request: Request, body: _Common, ids: list[int], *, chat: bool, max_tokens, logprobs: int):
        if max_tokens is None:
            max_tokens = min(default_max_tokens if not chat else 256, max(engine.ctx - len(ids), 0))
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little")
        try:
            engine.check_prompt(ids, max_tokens)
            sampling = [SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                       top_p=body.top_p, seed=(seed + i) % 2**63, stop_strings=tuple(stop),
                                       logprobs=logprobs) for i in range(body.n)]
        except JaxsmolError as e:
            return error_response(400, str(e))
        job = Job(prompt_ids=ids, sampling=sampling, salt=body.cache_salt, bypass=not body.use_prefix_cache,
                  loop=asyncio.get_running_loop(), return_token_ids=body.return_token_ids)
        try:
            worker.submit(job)
        except QueueFull:
            metrics.rejected_queue_full += 1
            return error_response(503, "the server is busy: request queue full", type_="server_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": model_name}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_sse(request, job, meta, chat, include_usage, len(ids)),
                                     media_type="text/event-stream")
        return await _collect(request, job, meta, chat, len(ids))

    async def _next_event(request: Request, job: Job):
        """The job's next event; cancels the job (and returns None) if the client has gone.

        The client is checked before every event, not only while none comes: tokens arriving faster
        than the wait below must not keep a job alive after its client left."""
        while True:
            if await request.is_disconnected():
                job.cancelled.set()
                return None
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                pass

    async def _collect(request, job, meta, chat, n_prompt):
        choices, usage = {}, _usage(n_prompt)
        while (event := await _next_event(request, job)) is not None:
            kind = event[0]
            if kind == "error":
                return _job_error(event[1])
            if kind == "done":
                _, index, gen, report = event
                choices[index] = _choice(index, gen, chat)
                if job.return_token_ids:
                    choices[index]["token_ids"] = gen.output_ids
                _add_usage(usage, gen, report)
            if kind == "end" or len(choices) == len(job.sampling):
                break
        if event is None:
            return error_response(499, "client closed the request")
        obj = {**meta, "object": "chat.completion" if chat else "text_completion",
               "choices": [choices[i] for i in sorted(choices)], "usage": usage}
        return JSONResponse(obj)

    async def _sse(request, job, meta, chat, include_usage, n_prompt):
        obj_type = "chat.completion.chunk" if chat else "text_completion"
        usage = _usage(n_prompt)
        started, finished = set(), 0
        try:
            while (event := await _next_event(request, job)) is not None:
                kind = event[0]
                if kind == "end":
                    break
                if kind == "error":
                    yield f"data: {json.dumps(json.loads(_job_error(event[1]).body))}\n\n"
                    break
                index = event[1]
                if kind == "token":
                    step = event[2]
                    if chat:
                        delta = {"content": step.text}
                        if index not in started:
                            delta = {"role": "assistant", **delta}
                            started.add(index)
                        choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs_steps([step]),
                                  "finish_reason": None}
                    else:
                        choice = {"index": index, "text": step.text,
                                  "logprobs": _completion_logprobs_steps([step]), "finish_reason": None}
                    yield f"data: {json.dumps({**meta, 'object': obj_type, 'choices': [choice]})}\n\n"
                elif kind == "done":
                    gen, report = event[2], event[3]
                    _add_usage(usage, gen, report)
                    choice = ({"index": index, "delta": {}, "logprobs": None, "finish_reason": gen.finish_reason}
                              if chat else {"index": index, "text": "", "logprobs": None,
                                            "finish_reason": gen.finish_reason})
                    if job.return_token_ids:
                        choice["token_ids"] = gen.output_ids
                    yield f"data: {json.dumps({**meta, 'object': obj_type, 'choices': [choice]})}\n\n"
                    finished += 1
                    if finished == len(job.sampling):
                        break
            if include_usage:
                yield f"data: {json.dumps({**meta, 'object': obj_type, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a no-op when finished; stops generation when the stream is dropped

    def _token_str(token_id: int) -> str:
        return engine.tokenizer.decode([token_id])

    def _completion_logprobs_steps(steps):
        if not steps or steps[0].top_logprobs is None:
            return None
        return {"tokens": [_token_str(s.token) for s in steps], "token_logprobs": [s.logprob for s in steps],
                "top_logprobs": [{_token_str(i): lp for i, lp in s.top_logprobs} for s in steps]}

    def _chat_logprobs_steps(steps):
        if not steps or steps[0].top_logprobs is None:
            return None

        def entry(i, lp):
            s = _token_str(i)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(i, lp) for i, lp in s.top_logprobs]}
                            for s in steps]}

    def _choice(index, gen, chat):
        from jaxsmol.engine import Step
        steps = [Step(token=p["token"], text="", top_logprobs=p["top"], logprob=p["logprob"]) for p in gen.logprobs]
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": gen.text},
                    "logprobs": _chat_logprobs_steps(steps), "finish_reason": gen.finish_reason}
        lp = _completion_logprobs_steps(steps)
        if lp is not None:
            offsets, pos = [], 0
            for t in lp["tokens"]:
                offsets.append(pos)
                pos += len(t)
            lp["text_offset"] = offsets
        return {"index": index, "text": gen.text, "logprobs": lp, "finish_reason": gen.finish_reason}

    def _usage(n_prompt):
        return {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt,
                "prompt_tokens_details": {"cached_tokens": 0}}

    def _add_usage(usage, gen, report):
        usage["completion_tokens"] += len(gen.output_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        # for n > 1 report the first choice's reuse: the prompt is counted once
        if usage["prompt_tokens_details"]["cached_tokens"] == 0:
            usage["prompt_tokens_details"]["cached_tokens"] = report.reused

    def _job_error(exc):
        if isinstance(exc, JaxsmolError):
            return error_response(400, str(exc))
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")

    return app


def serve(engine, host: str, port: int, **kw) -> None:
    import uvicorn

    app = create_app(engine, **kw)
    # uvicorn drains on SIGTERM, then raises the signal again once it has restored the previous handler:
    # with the default handler that kills the drained process (exit status -15). A drained stop is a clean exit.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=120)
    finally:
        signal.signal(signal.SIGTERM, previous)
