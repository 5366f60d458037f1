"""Running /v1/completions and /v1/chat/completions: request -> Job -> events -> response.

`completion_plan` / `chat_plan` (run off the event loop) tokenize, render the chat template, check
prompts and limits, and return the job's `ChoiceSpec`s with a `View` of how to render the answer.
`answer` submits the job to the worker and relays its events (cli/api/events.py): collected into one
JSON body, or as server-sent events. `start` (a job queued) and `results` (its choices' results) are
the driver's two halves, which the Messages API's routes use too (cli/server/messages.py); a failure is
raised as a ProtocolError, which the app answers in the route's own error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api import responses as R
from jaxsmol.cache.named import Named
from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, Job, JobEnd, JobError, PromptDone, TokenEvent
from jaxsmol.cli.server.access_log import AccessRecord, record
from jaxsmol.cli.server.tenants import Tenant, cache_salt
from jaxsmol.cli.server.worker import QueueFull, Worker
from jaxsmol.errors import JaxsmolError

RETRY_AFTER_S = 1
# A request's client is checked before an event at most every CLIENT_CHECK_S while its events flow,
# and every IDLE_CHECK_S while none come.
CLIENT_CHECK_S, IDLE_CHECK_S = 0.05, 0.25


@dataclasses.dataclass
class EventReader:
    """A job's events as its HTTP request reads them (the first one's time noted in its access record)."""
    request: Request
    job: Job
    checked: float = float("-inf")  # when the client was last found connected
    access: AccessRecord = dataclasses.field(init=False)

    def __post_init__(self):
        self.access = record(self.request)

    async def next(self):
        """The job's next event; cancels the job (and returns None) if the client has gone.

        The client is checked before an event when CLIENT_CHECK_S have passed since the last check,
        not only while none comes: tokens arriving faster than the wait below must not keep a job
        alive after its client left. Not before every event: that check (a cancelled receive) and a
        wait_for (a new task) were ~40% of the event loop's time a streamed token (py-spy, 8
        clients), and a step's events come together. A job the worker cancelled (its client did
        not read for the write timeout) ends once its queue is empty."""
        job = self.job
        while True:
            if time.monotonic() - self.checked >= CLIENT_CHECK_S:
                if await self.request.is_disconnected():
                    job.cancelled.set()
                    return None
                self.checked = time.monotonic()
            event = job.next_event_nowait()
            if event is None:
                try:
                    event = await asyncio.wait_for(job.next_event(), timeout=IDLE_CHECK_S)
                except asyncio.TimeoutError:
                    if job.cancelled.is_set() and job.idle():
                        return None
                    continue
            if isinstance(event, (TokenEvent, ChoiceDone)):
                self.access.note_token()
            return event


@dataclasses.dataclass(frozen=True)
class View:
    """How a job's results become a response.

    logprobs: completions' top-k (None: not asked), or chat's top_logprobs (None: logprobs false);
    prompt_logprobs: vLLM's extension (None: not asked); prompt_texts: per prompt, for echo."""
    chat: bool
    n: int
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_texts: tuple[str, ...] = ()


class Completions:
    def __init__(self, engine, worker: Worker, metrics, model_name: str, write_timeout_s: float):
        self.engine, self.worker, self.metrics = engine, worker, metrics
        self.model_name, self.write_timeout_s = model_name, write_timeout_s

    def decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    # ---- plans (worker-free, off the event loop) ---------------------------------------------------
    def tokenize(self, body: P.TokenizeRequest) -> list[int]:
        tok = self.engine.tokenizer
        if body.messages is not None:
            text = tok.apply_chat_template(P.template_messages(body.messages),
                                           add_generation_prompt=body.add_generation_prompt)
        else:
            text = P.check_text(body.prompt, "prompt")
        return tok.encode(text)

    def prefix_ids(self, messages: list[dict] | None, prompt, where: str, generation: bool = False) -> list[int]:
        """The token ids of chat-template `messages` (the assistant's turn opened with `generation`) or
        else of `prompt` (text or token ids), checked to fit the context: a prefix to pin (POST
        /v1/cache/pin, /v1/cached_contents); ProtocolError naming `where`."""
        tok = self.engine.tokenizer
        if tok is None and not isinstance(prompt, list):
            raise P.ProtocolError(f"{where}: this model has no tokenizer; give a prompt of token ids", param=where)
        if messages is not None:
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=generation))
        else:
            ids = tok.encode(P.check_text(prompt, where)) if isinstance(prompt, str) else prompt
        try:
            return self.engine.check_prompt(ids, 0)
        except JaxsmolError as e:
            raise P.ProtocolError(f"{where}: {e}", param=where) from None

    def checked_prompt(self, ids: list[int], max_tokens: int | None, kind: str, where: str) -> tuple[list[int], int]:
        """(ids, max_tokens) with the default max_tokens, or a ProtocolError naming the prompt."""
        if max_tokens is None:
            max_tokens = min(P.DEFAULT_MAX_TOKENS[kind], max(self.engine.ctx - len(ids), 0))
        try:
            return self.engine.check_prompt(ids, max_tokens), max_tokens
        except JaxsmolError as e:
            raise P.ProtocolError(f"{where}: {e}", param=where.split(".")[0]) from None

    def _specs(self, body, prompts: list[tuple[list[int], int]], logprobs: int, echo: bool,
               prompt_logprobs: int | None) -> list[ChoiceSpec]:
        """One ChoiceSpec per prompt x n (index p * n + j, seed + j)."""
        P.check_work(len(prompts), body.n, max(m for _, m in prompts))
        stops = P.stop_strings(body.stop)
        structured = P.structured_spec(body)
        seed = P.request_seed(body.seed)
        return [ChoiceSpec(index=p * body.n + j, prompt_ids=ids, echo=echo, prompt_logprobs=prompt_logprobs,
                           sampling=P.sampling_for(body, max_tokens, logprobs, seed, j, stops, structured))
                for p, (ids, max_tokens) in enumerate(prompts) for j in range(body.n)]

    def completion_plan(self, body: P.CompletionRequest, start: Named | None = None) -> tuple[list[ChoiceSpec], View]:
        """The request's choices, each prompt after the cached content `start`'s tokens if one is named."""
        raw = P.completion_prompts(body.prompt)
        tok = self.engine.tokenizer
        if start is not None and (body.echo or body.prompt_logprobs is not None):
            raise P.ProtocolError("cached_content: echo and prompt_logprobs are not given with a cached content",
                                  param="cached_content")
        prompts, texts = [], []
        for i, p in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt.{i}"
            ids = tok.encode(p) if isinstance(p, str) else p
            ids = ids if start is None else list(start.tokens) + list(ids)
            prompts.append(self.checked_prompt(ids, body.max_tokens, "completion", where))
            if body.echo:
                texts.append(p if isinstance(p, str) else tok.decode(ids))
        scored = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        # logprobs 0 still reports the chosen token's logprob: the sampler is asked for one
        sample_k = 0 if body.logprobs is None else max(body.logprobs, 1)
        specs = self._specs(body, prompts, sample_k, body.echo, max(scored) if scored else None)
        return specs, View(chat=False, n=body.n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs,
                           prompt_texts=tuple(texts))

    def chat_plan(self, body: P.ChatRequest, start: Named | None = None) -> tuple[list[ChoiceSpec], View]:
        """The request's choices: its messages after the cached content `start`'s, if one is named."""
        messages = P.template_messages(body.messages)
        if start is not None:
            if start.messages is None:
                raise P.ProtocolError(f"cached_content: {start.name} holds a prompt, not messages: use it with "
                                      "/v1/completions", param="cached_content")
            messages = [dict(m) for m in start.messages] + messages
        ids = self.engine.tokenizer.encode(self.engine.tokenizer.apply_chat_template(messages))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt = self.checked_prompt(ids, max_tokens, "chat", "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        specs = self._specs(body, [prompt], 0 if top is None else max(top, 1), False, None)
        return specs, View(chat=True, n=body.n, logprobs=top)

    # ---- running a job -----------------------------------------------------------------------------
    def start(self, tenant: Tenant, specs: list[ChoiceSpec], salt: str | None = None, bypass: bool = False,
              **fields) -> Job:
        """A job of these choices in the tenant's cache namespace (`salt`: a cache_salt within it), with
        the Job's other `fields`, queued for the worker; a 503 ProtocolError (Retry-After) when the
        queue is full."""
        job = Job(choices=specs, salt=cache_salt(tenant, salt), bypass=bypass, loop=asyncio.get_running_loop(),
                  write_timeout_s=self.write_timeout_s, **fields)
        try:
            self.worker.submit(job)
        except QueueFull:
            self.metrics.rejected_queue_full += 1
            raise P.ProtocolError("the server is busy: request queue full", status=503, type_="server_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return job

    async def results(self, events: EventReader) -> list[ChoiceResult]:
        """The job's results, in index order, once every choice is done; raises its failure as a
        ProtocolError (job_failure), or a 499 one when the client left."""
        results: dict[int, ChoiceResult] = {}
        while (event := await events.next()) is not None:
            if isinstance(event, JobError):
                raise job_failure(event.error)
            if isinstance(event, ChoiceDone):
                results[event.result.index] = event.result
            if isinstance(event, JobEnd) or len(results) == len(events.job.choices):
                break
        if len(results) < len(events.job.choices):
            raise P.ProtocolError("client closed the request", status=499)
        return [results[i] for i in sorted(results)]

    async def answer(self, request: Request, body, tenant: Tenant, specs: list[ChoiceSpec], view: View,
                     salt: str | None):
        """Run the plan's choices in the cache namespace `salt` (P.request_salt) and answer them."""
        job = self.start(tenant, specs, salt, bypass=not body.use_prefix_cache,
                         return_token_ids=body.return_token_ids, retain_s=P.RETENTION_S[body.prompt_cache_retention])
        meta = {"id": ("chatcmpl-" if view.chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": self.model_name}
        events = EventReader(request, job)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(events, meta, view, include_usage), media_type="text/event-stream")
        results = await self.results(events)
        obj = await asyncio.to_thread(self._response, job, meta, view, results)
        events.access.note_usage(obj["usage"])
        return JSONResponse(obj)

    def _response(self, job: Job, meta: dict, view: View, results: list[ChoiceResult]) -> dict:
        decode, ret = self.decode_one, job.return_token_ids
        if view.chat:
            choices = [R.chat_choice(r, decode, top_logprobs=view.logprobs, return_token_ids=ret) for r in results]
        else:
            texts = view.prompt_texts
            choices = [R.completion_choice(r, job.choices[r.index], decode, logprobs=view.logprobs,
                                           prompt_logprobs=view.prompt_logprobs, return_token_ids=ret,
                                           prompt_text=texts[r.index // view.n] if texts else "")
                       for r in results]
        return R.completion_object(meta, choices, R.usage(results, view.n), view.chat)

    async def _sse(self, events: EventReader, meta: dict, view: View, include_usage: bool):
        results: list[ChoiceResult] = []
        offsets: dict[int, int] = {}  # choice -> characters sent (completions' text_offset)
        job = events.job
        try:
            while (event := await events.next()) is not None:
                if isinstance(event, JobEnd):
                    break
                if isinstance(event, JobError):
                    e = job_failure(event.error)
                    yield R.sse(P.error_body(e.status, e.message, e.type))
                    break
                if isinstance(event, PromptDone):
                    continue
                index = event.index if isinstance(event, TokenEvent) else event.result.index
                first = index not in offsets
                if first:
                    offsets[index] = 0
                    if job.choices[index].echo:
                        text = view.prompt_texts[index // view.n]
                        offsets[index] = len(text)
                        yield R.sse(R.chunk(meta, False, [{"index": index, "text": text, "logprobs": None,
                                                           "finish_reason": None}]))
                if isinstance(event, TokenEvent):
                    yield R.sse(R.chunk(meta, view.chat, [self._token_choice(event, view, offsets[index], first)]))
                    offsets[index] += len(event.step.text)
                else:
                    results.append(event.result)
                    yield R.sse(R.chunk(meta, view.chat, [R.final_choice(event.result, view.chat,
                                                                         job.return_token_ids)]))
                    if len(results) == len(job.choices):
                        break
            usage = R.usage(results, view.n)
            events.access.note_usage(usage)
            if include_usage:
                yield R.sse(R.chunk(meta, view.chat, [], usage))
            yield R.SSE_DONE
        finally:
            job.cancelled.set()  # a no-op when finished; stops generation when the stream is dropped

    def _token_choice(self, event: TokenEvent, view: View, offset: int, first: bool) -> dict:
        if view.chat:
            return R.chat_token_choice(event.index, event.step, self.decode_one, view.logprobs, first)
        return R.completion_token_choice(event.index, event.step, self.decode_one, view.logprobs, offset)


def job_failure(exc: Exception) -> P.ProtocolError:
    """A job's failure as the client sees it: a JaxsmolError is the request's fault (400), anything
    else the server's (500)."""
    if isinstance(exc, JaxsmolError):
        return P.ProtocolError(str(exc))
    return P.ProtocolError(f"internal error: {type(exc).__name__}: {exc}", status=500, type_="server_error")
