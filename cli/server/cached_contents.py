"""Named cached contents (cli/api/cached_contents.py): a prefix prefilled once, pinned for its lifetime
under a name, and referenced by name from chat and completion requests (`cached_content`).

  POST   /v1/cached_contents          contents (or messages, or a prompt) and a lifetime -> the object
  GET    /v1/cached_contents          the caller's contents, the newest first
  GET    /v1/cached_contents/{name}   one ("cachedContents/ID" or ID)
  PATCH  /v1/cached_contents/{name}   a new ttl or expire_time
  DELETE /v1/cached_contents/{name}   released now

The prefill runs on the job driver as a pin request whose pin is held by the name for its TTL
(cache/pins.py); the registry (cache/named.py) is read and changed under the worker's lock, never beside
a step. A name is its tenant's: another tenant's name is answered 404 as one that does not exist.
Lifetimes are scaled by $JAXSMOL_TEST_TTL_SCALE as the Messages API's cache_control TTLs are.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from jaxsmol.cache.named import Named, new_name
from jaxsmol.cache.records import PinOrder
from jaxsmol.cli.api import cached_contents as G
from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api.events import ChoiceSpec
from jaxsmol.cli.server.completions import Completions, EventReader
from jaxsmol.cli.server.tenants import Tenant, cache_salt
from jaxsmol.runtime.sampling import SamplingParams


class CachedContents:
    def __init__(self, runner: Completions, cache, authenticate, locked, ttl_scale: float = 1.0):
        """authenticate(request) -> Tenant; locked(fn) runs fn under the worker's lock."""
        self.runner, self.cache = runner, cache
        self.authenticate, self.locked, self.ttl_scale = authenticate, locked, ttl_scale

    def _object(self, n: Named) -> dict:
        return G.content_object(n.name, self.runner.model_name, n.display_name, len(n.tokens), n.created, n.updated,
                                self.cache.named.expires_at(n), n.cache_salt)

    async def _find(self, tenant: Tenant, name: str) -> Named:
        found = await asyncio.to_thread(self.locked, lambda: self.cache.named.get(name, tenant.namespace))
        if found is None:
            raise P.ProtocolError(f"no cached content {name!r}", param="name", status=404, type_="not_found_error")
        return found

    async def create(self, body: G.CreateRequest, request: Request):
        tenant = self.authenticate(request)
        now = time.time()
        seconds = G.ttl_seconds(body, now) * self.ttl_scale
        messages = G.chat_messages(body)
        where = "prompt" if body.prompt is not None else "messages" if body.messages is not None else "contents"
        ids = await asyncio.to_thread(self.runner.prefix_ids, messages, body.prompt, where)
        await asyncio.to_thread(self.locked, self.cache.named.check_room)
        ns = self.cache.namespace(cache_salt(tenant, body.cache_salt))
        n = Named(new_name(), tenant.namespace, body.cache_salt, ns, tuple(ids),
                  None if messages is None else tuple(messages), body.display_name, now, now)
        spec = ChoiceSpec(index=0, prompt_ids=ids, sampling=SamplingParams(max_tokens=0))
        job = self.runner.start(tenant, [spec], body.cache_salt, pin=PinOrder(seconds, n.name, n.record()))
        await self.runner.results(EventReader(request, job))
        return await asyncio.to_thread(self.locked, lambda: (self.cache.named.add(n), self._object(n))[1])

    async def list(self, request: Request):
        tenant = self.authenticate(request)
        items = await asyncio.to_thread(self.locked, lambda: [self._object(n) for n in
                                                              self.cache.named.listing(tenant.namespace)])
        return {"cached_contents": items}

    async def get(self, name: str, request: Request):
        found = await self._find(self.authenticate(request), name)
        return await asyncio.to_thread(self.locked, lambda: self._object(found))

    async def update(self, name: str, body: G.UpdateRequest, request: Request):
        found = await self._find(self.authenticate(request), name)
        seconds = G.ttl_seconds(body, time.time(), default=None) * self.ttl_scale
        return await asyncio.to_thread(self.locked, lambda: self._object(self.cache.named.set_ttl(found, seconds)))

    async def delete(self, name: str, request: Request):
        found = await self._find(self.authenticate(request), name)
        await asyncio.to_thread(self.locked, lambda: self.cache.named.delete(found))
        return {}


def install_cached_contents_routes(app, routes: CachedContents) -> None:
    app.post(G.PATH)(routes.create)
    app.get(G.PATH)(routes.list)
    app.get(G.PATH + "/{name:path}")(routes.get)
    app.patch(G.PATH + "/{name:path}")(routes.update)
    app.delete(G.PATH + "/{name:path}")(routes.delete)
