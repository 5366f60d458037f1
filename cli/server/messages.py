"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, run on the
completions' job driver (cli/server/completions.py `start`, `results`, `EventReader`).

`plan` (off the event loop) converts the request (cli/api/anthropic.py), renders it with the model's
chat template, tokenizes it and checks it, and finds each `cache_control` breakpoint's position: the
conversation rendered up to and including the breakpoint's block, tokenized, and its common prefix with
the prompt's ids (a text boundary may tokenize otherwise inside the whole prompt). The job keeps those
prefixes pinned for their TTL once the prompt is stored (cache/pins.py `keep`), and its events become
one message or Anthropic's stream of events. Usage: `cache_read_input_tokens` are the positions the
prefix cache restored, `cache_creation_input_tokens` those the breakpoints newly kept past them.

The TTLs are scaled by $JAXSMOL_TEST_TTL_SCALE (a hook for tests: 0.01 makes "5m" 3 s); unset, 1.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.cli.api import anthropic as A
from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api import responses as R
from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, JobError, PromptDone, TokenEvent
from jaxsmol.cli.api.structured_request import structured_from_request
from jaxsmol.cli.server.completions import Completions, EventReader, job_failure
from jaxsmol.errors import JaxsmolError

TTL_SCALE_ENV = "JAXSMOL_TEST_TTL_SCALE"


class Messages:
    def __init__(self, runner: Completions, authenticate, ttl_scale: float | None = None):
        """authenticate(request) -> Tenant; ttl_scale: the breakpoints' TTLs times this (None: from the
        environment's TTL_SCALE_ENV, else 1)."""
        self.runner, self.engine, self.authenticate = runner, runner.engine, authenticate
        self.ttl_scale = float(os.environ.get(TTL_SCALE_ENV, "1")) if ttl_scale is None else ttl_scale

    # ---- plans (off the event loop) ----------------------------------------------------------------
    def _tokenizer(self):
        if self.engine.tokenizer is None:
            raise P.ProtocolError("messages: this model has no tokenizer", param="messages")
        return self.engine.tokenizer

    def _ids(self, messages, generation: bool = False) -> list[int]:
        tok = self._tokenizer()
        return tok.encode(tok.apply_chat_template(list(messages), add_generation_prompt=generation))

    def prompt_ids(self, body: A.CountRequest, conv: A.Conversation) -> list[int]:
        """The conversation's prompt: rendered with the assistant's turn opened, or with the final
        assistant message left open for the answer to continue (a prefill)."""
        if not conv.prefill:
            return self._ids(conv.messages, generation=True)
        tok = self._tokenizer()
        text = A.continue_final(lambda m: tok.apply_chat_template(m, add_generation_prompt=False), conv.messages,
                                f"messages.{len(body.messages) - 1}.content")
        return tok.encode(text)

    def _breakpoints(self, conv: A.Conversation, ids: list[int]) -> tuple[tuple[int, float], ...]:
        """(position in `ids`, TTL in seconds) of each breakpoint."""
        return tuple((common_prefix_len(self._ids(b.messages), ids), b.ttl_s * self.ttl_scale)
                     for b in conv.breakpoints)

    def plan(self, body: A.MessagesRequest) -> tuple[ChoiceSpec, tuple]:
        """The request's one choice, and its breakpoints (Job.keep)."""
        conv = A.conversation(body)
        ids, max_tokens = self.runner.checked_prompt(self.prompt_ids(body, conv), body.max_tokens, "chat", "messages")
        P.check_work(1, 1, max_tokens)
        stops = P.stop_strings(body.stop_sequences, "stop_sequences")
        try:
            structured = structured_from_request({"response_format": A.structured_format(body.output_config)})
        except JaxsmolError as e:
            raise P.ProtocolError(f"output_config.format: {e}", param="output_config") from None
        sampling = P.sampling_for(body, max_tokens, 0, P.request_seed(body.seed), 0, stops, structured)
        return ChoiceSpec(index=0, prompt_ids=ids, sampling=sampling), self._breakpoints(conv, ids)

    def count(self, body: A.CountRequest) -> int:
        return len(self.prompt_ids(body, A.conversation(body)))

    # ---- routes ------------------------------------------------------------------------------------
    async def count_tokens(self, body: A.CountRequest, request: Request):
        self.authenticate(request)
        return {"input_tokens": await asyncio.to_thread(self.count, body)}

    async def create(self, body: A.MessagesRequest, request: Request):
        tenant = self.authenticate(request)
        spec, keep = await asyncio.to_thread(self.plan, body)
        job = self.runner.start(tenant, [spec], body.cache_salt, keep=keep)
        meta = {"id": "msg_" + uuid.uuid4().hex[:24], "model": self.runner.model_name}
        events = EventReader(request, job)
        if body.stream:
            return StreamingResponse(self._stream(events, meta), media_type="text/event-stream")
        [result] = await self.runner.results(events)
        events.access.note_usage(R.usage([result], 1))
        return JSONResponse(A.message(meta, result.text, _reason(result), _usage(result)))

    async def _stream(self, events: EventReader, meta: dict):
        """Anthropic's events: message_start once the prompt is in (its usage then known), a text delta
        a token, the stop; a failure as an `error` event."""
        prompt_tokens = len(events.job.choices[0].prompt_ids)
        try:
            while (event := await events.next()) is not None:
                if isinstance(event, PromptDone):
                    yield A.stream_start(meta, A.usage(prompt_tokens, event.cached_tokens, event.kept_tokens, 0))
                elif isinstance(event, TokenEvent):
                    if event.step.text:  # "" while a character or a possible stop sequence is held back
                        yield A.text_delta(event.step.text)
                elif isinstance(event, ChoiceDone):
                    events.access.note_usage(R.usage([event.result], 1))
                    yield A.stream_end(_reason(event.result), _usage(event.result))
                    break
                elif isinstance(event, JobError):
                    e = job_failure(event.error)
                    yield A.event("error", error=A.error_body(A.error_status(e.status), e.message)["error"])
                    break
                else:  # JobEnd
                    break
        finally:
            events.job.cancelled.set()  # a no-op when finished; stops generation when the stream is dropped


def _reason(r: ChoiceResult) -> tuple[str, str | None]:
    return A.stop_reason(r.finish_reason, r.stop_string)


def _usage(r: ChoiceResult) -> dict:
    return A.usage(r.prompt_tokens, r.cached_tokens, r.kept_tokens, len(r.output_ids))


def install_messages_routes(app, messages: Messages) -> None:
    app.post("/v1/messages")(messages.create)
    app.post("/v1/messages/count_tokens")(messages.count_tokens)
