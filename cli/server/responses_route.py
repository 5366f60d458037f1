"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: OpenAI's
Responses API, run on the completions' job driver (cli/server/completions.py `start`, `results`,
`EventReader`), its protocol in cli/api/openai_responses.py.

`plan` (off the event loop) converts the input items, puts the earlier turns of a chained request
(`previous_response_id`, from the store) before them and the instructions before all, renders them
with the model's chat template as the chat route does, tokenizes and checks them. The job's events
become one response object or the API's stream of events; a response asked to be stored is kept in
the tenant's part of the store (cli/server/response_store.py) once its answer is done.
`prompt_cache_key` is the request's cache_salt (a cache namespace within the tenant); a chained
request without one takes its previous response's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cli.api import openai_responses as O
from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api import responses as R
from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, JobEnd, JobError, TokenEvent
from jaxsmol.cli.api.structured_request import structured_from_request
from jaxsmol.cli.server.completions import Completions, EventReader, job_failure
from jaxsmol.cli.server.response_store import ResponseStore, Stored
from jaxsmol.cli.server.tenants import Tenant
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams


def _not_found(response_id: str, param: str | None = None) -> P.ProtocolError:
    # one answer for an unknown, deleted, evicted or another tenant's id: a tenant learns nothing of others'
    where = f"{param}: " if param else ""
    return P.ProtocolError(f"{where}no stored response with id {response_id!r} (never stored, deleted, or evicted)",
                           param=param, status=404)


@dataclasses.dataclass(frozen=True)
class Save:
    """What a stored response keeps of its request: the conversation's turns, the last `inputs` of them its own."""
    turns: list
    inputs: int


class Responses:
    def __init__(self, runner: Completions, authenticate, store: ResponseStore | None = None):
        """authenticate(request) -> Tenant."""
        self.runner, self.engine, self.authenticate = runner, runner.engine, authenticate
        self.store = store if store is not None else ResponseStore()

    # ---- plans (off the event loop) ----------------------------------------------------------------
    def _structured(self, body: O.ResponsesRequest) -> str | None:
        try:
            return structured_from_request({"response_format": O.structured_format(body.text)})
        except JaxsmolError as e:
            raise P.ProtocolError(f"text.format: {e}", param="text.format") from None

    def plan(self, body: O.ResponsesRequest, earlier: tuple) -> tuple[ChoiceSpec, list[dict]]:
        """The request's one choice, and the conversation's turns (without the instructions)."""
        if self.engine.tokenizer is None:
            raise P.ProtocolError("input: this model has no tokenizer", param="input")
        turns = list(earlier) + O.input_messages(body.input)
        tok = self.engine.tokenizer
        ids = tok.encode(tok.apply_chat_template(O.prompt_messages(body.instructions, turns)))
        ids, max_tokens = self.runner.checked_prompt(ids, body.max_output_tokens, "chat", "input")
        if max_tokens > P.MAX_WORK_TOKENS:
            raise P.ProtocolError(f"max_output_tokens: over the limit of {P.MAX_WORK_TOKENS} generated tokens a "
                                  "request", param="max_output_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=0,
                                  top_p=1.0 if body.top_p is None else body.top_p, seed=P.request_seed(body.seed),
                                  structured=self._structured(body))
        return ChoiceSpec(index=0, prompt_ids=ids, sampling=sampling), turns

    # ---- routes ------------------------------------------------------------------------------------
    def _previous(self, tenant: Tenant, response_id: str | None) -> Stored | None:
        if response_id is None:
            return None
        stored = self.store.get(tenant.namespace, response_id)
        if stored is None:
            raise _not_found(response_id, "previous_response_id")
        return stored

    async def create(self, body: O.ResponsesRequest, request: Request):
        tenant = self.authenticate(request)
        O.refuse_unsupported(body)
        previous = self._previous(tenant, body.previous_response_id)
        cache_key = body.prompt_cache_key if body.prompt_cache_key is not None or previous is None \
            else previous.cache_key
        earlier = previous.conversation if previous else ()
        spec, turns = await asyncio.to_thread(self.plan, body, earlier)
        save = Save(turns, len(turns) - len(earlier)) if body.store else None
        job = self.runner.start(tenant, [spec], cache_key, retain_s=P.RETENTION_S[body.prompt_cache_retention])
        head = O.Head(id="resp_" + uuid.uuid4().hex, item_id="msg_" + uuid.uuid4().hex, created_at=int(time.time()),
                      model=self.runner.model_name, echo=O.echo(body, cache_key))
        events = EventReader(request, job)
        if body.stream:
            return StreamingResponse(self._stream(events, head, tenant, save),
                                     media_type="text/event-stream")
        [result] = await self.runner.results(events)
        return JSONResponse(self._finish(events, head, result, tenant, save))

    def _finish(self, events: EventReader, head: O.Head, result: ChoiceResult, tenant: Tenant,
                save: Save | None) -> dict:
        """The response object of a done answer, noted in the access log and stored where `save` says."""
        events.access.note_usage(R.usage([result], 1))
        usage = O.usage(result.prompt_tokens, result.cached_tokens, len(result.output_ids))
        response = O.final_response(head, result.text, result.finish_reason, usage, int(time.time()))
        if save is not None:
            self.store.put(tenant.namespace, response, save.turns + [{"role": "assistant", "content": result.text}],
                           head.echo["prompt_cache_key"], save.inputs)
        return response

    async def _stream(self, events: EventReader, head: O.Head, tenant: Tenant, save: Save | None):
        """The API's events: the response created, a text delta a token, the response done; a failure as
        an `error` event."""
        out = O.Events()
        try:
            yield out.opening(head)
            while (event := await events.next()) is not None:
                if isinstance(event, TokenEvent):
                    if event.step.text:  # "" while a character is held back
                        yield out.delta(head, event.step.text)
                elif isinstance(event, ChoiceDone):
                    yield out.closing(self._finish(events, head, event.result, tenant, save))
                    break
                elif isinstance(event, JobError):
                    e = job_failure(event.error)
                    yield out.error(e.message, e.type, e.param)
                    break
                elif isinstance(event, JobEnd):
                    break
        finally:
            events.job.cancelled.set()  # a no-op when finished; stops generation when the stream is dropped

    async def retrieve(self, response_id: str, request: Request):
        stored = self.store.get(self.authenticate(request).namespace, response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    async def input_items(self, response_id: str, request: Request, limit: int = 20, order: str = "desc",
                          after: str | None = None):
        stored = self.store.get(self.authenticate(request).namespace, response_id)
        if stored is None:
            raise _not_found(response_id)
        inputs = list(stored.conversation[-1 - stored.inputs:-1])
        return O.input_items(response_id, inputs, limit, order, after)

    async def delete(self, response_id: str, request: Request):
        if not self.store.delete(self.authenticate(request).namespace, response_id):
            raise _not_found(response_id)
        return O.deleted(response_id)


def install_responses_routes(app, responses: Responses) -> None:
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.get("/v1/responses/{response_id}/input_items")(responses.input_items)
    responses.runner.metrics.registry.register(responses.store)  # jaxsmol_responses_* in /metrics
