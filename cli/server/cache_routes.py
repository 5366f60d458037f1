"""The prefix cache an operator steers: pinned prefixes and inspection (admin routes).

  POST   /v1/cache/pin   a prompt (text, token ids or chat messages) prefilled once through the
                         scheduler and pinned in the caller's cache namespace (cache/pins.py): kept
                         out of LRU eviction under --pinned-bytes, written to the disk tier marked
                         pinned so a restart pins it again
  DELETE /v1/cache/pin   the same prompt, or {"key": KEY} as GET /v1/cache names it: back to the LRU
  GET    /v1/cache       namespaces and entries (tokens, bytes, hits, last use, pinned), largest first,
                         ?limit=&offset= (cache/listing.py)

All three need an admin key when API keys are configured (cli/server/tenants.py). The tree is read and
changed under the worker's lock, never beside a step.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from jaxsmol.cache.records import PinOrder
from jaxsmol.cache.listing import find_pinned, listing, split_salt
from jaxsmol.cache.store.disk import SUFFIX, entry_key
from jaxsmol.cache.store.snapshot import identity
from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api.events import ChoiceSpec
from jaxsmol.cli.server.completions import Completions, EventReader
from jaxsmol.cli.server.tenants import cache_salt
from jaxsmol.runtime.sampling import SamplingParams


class PinRequest(BaseModel):
    """A prompt to pin or unpin: `prompt` (a string or token ids) or `messages` (through the chat
    template, without the assistant's turn unless add_generation_prompt), in the caller's namespace
    and `cache_salt`."""
    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr | P.TokenIds | None = None
    messages: list[P.Message] | None = None
    add_generation_prompt: bool = False
    cache_salt: str | None = Field(default=None, max_length=256)


class UnpinRequest(PinRequest):
    key: StrictStr | None = None  # an entry's key (GET /v1/cache), instead of the prompt


def _not_found(message: str) -> JSONResponse:
    return JSONResponse(P.error_body(404, message, "not_found_error"), status_code=404)


class CacheRoutes:
    def __init__(self, runner: Completions, cache, authenticate, locked):
        """runner: the job driver a pin's prefill runs on; authenticate(request, admin) -> Tenant;
        locked(fn) runs fn under the worker's lock."""
        self.runner, self.engine, self.cache = runner, runner.engine, cache
        self.authenticate, self.locked = authenticate, locked

    def _ids(self, body: PinRequest) -> list[int]:
        """The prompt's token ids (off the event loop); ProtocolError naming the field at fault."""
        if (body.prompt is None) == (body.messages is None):
            raise P.ProtocolError("give either prompt or messages", param="prompt")
        if body.messages is None:
            return self.runner.prefix_ids(None, body.prompt, "prompt")
        return self.runner.prefix_ids(P.template_messages(body.messages), None, "messages", body.add_generation_prompt)

    def _described(self, salt: str | None, ids) -> dict:
        ns = self.cache.namespace(salt)
        tenant, cs = split_salt(ns[1])
        return {"key": entry_key(identity(self.engine), ns[1], ids), "namespace": tenant, "cache_salt": cs,
                "tokens": len(ids)}

    async def pin(self, body: PinRequest, request: Request):
        tenant = self.authenticate(request, admin=True)
        ids = await asyncio.to_thread(self._ids, body)
        job = self.runner.start(tenant, [ChoiceSpec(index=0, prompt_ids=ids, sampling=SamplingParams(max_tokens=0))],
                                body.cache_salt, pin=PinOrder())
        [result] = await self.runner.results(EventReader(request, job))
        out = self._described(job.salt, ids)
        disk = self.cache.disk
        return {"pinned": True, **out, "cached_tokens": result.cached_tokens, "pinned_bytes": self.cache.pins.held,
                "pinned_budget_bytes": self.cache.pins.budget_bytes,
                "on_disk": disk is not None and out["key"] + SUFFIX in disk.entries}

    async def unpin(self, body: UnpinRequest, request: Request):
        tenant = self.authenticate(request, admin=True)
        if body.key is not None:
            found = await asyncio.to_thread(self.locked, lambda: find_pinned(self.cache, body.key))
            if found is None:
                return _not_found(f"no pinned entry {body.key}")
            ns, ids = found
            salt = ns[1]
        else:
            ids = await asyncio.to_thread(self._ids, body)
            salt = cache_salt(tenant, body.cache_salt)
            ns = self.cache.namespace(salt)
        if not await asyncio.to_thread(self.locked, lambda: self.cache.pins.unpin(ns, ids)):
            return _not_found("this prompt is not pinned in this namespace")
        return {"unpinned": True, **self._described(salt, ids), "pinned_bytes": self.cache.pins.held}

    async def show(self, request: Request, limit: int = 100, offset: int = 0):
        self.authenticate(request, admin=True)
        return await asyncio.to_thread(self.locked, lambda: listing(self.cache, limit, offset))


def install_cache_routes(app, routes: CacheRoutes) -> None:
    app.get("/v1/cache")(routes.show)
    app.post("/v1/cache/pin")(routes.pin)
    app.delete("/v1/cache/pin")(routes.unpin)
