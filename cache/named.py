"""Named cached contents: a prefix created once, kept for a TTL, and referenced by name (Gemini's cached
contents; the daemon's /v1/cached_contents, cli/server/cached_contents.py).

A content is a pinned key of the prefix cache held by its name (cache/pins.py: an expiring pin's
holder): it lives exactly as long as that hold, so the pin is the one truth about whether a name is
alive and when it expires, and `NamedContents` keeps only what the pin does not know (the tenant, the
messages the tokens render, names and times for the API). Expiries are kept on the pins' monotonic
clock and shown as wall-clock times. With a disk tier a content's file carries its record and expiry,
and a restart names it again for what is left of its TTL (`PrefixCache.warm_from_disk`).

A name is its tenant's: `get` and `listing` answer only the tenant that made it.
"""

from __future__ import annotations

import dataclasses
import secrets
import time

from jaxsmol.errors import JaxsmolError

PREFIX = "cachedContents/"
MAX_CONTENTS = 1024  # names held at once, every tenant's together (their bytes are bounded by --pinned-bytes)


@dataclasses.dataclass(frozen=True)
class Named:
    name: str  # PREFIX + 24 hex digits
    tenant: str | None  # the tenant's namespace (None: the default, no API keys)
    cache_salt: str | None
    ns: tuple  # the cache namespace its tokens are pinned in
    tokens: tuple
    messages: tuple | None  # the chat-template messages the tokens render; None for a prompt
    display_name: str
    created: float  # seconds since the epoch
    updated: float

    def record(self) -> dict:
        """What a disk file keeps of it (the file has the namespace's salt and the tokens)."""
        return {"name": self.name, "tenant": self.tenant, "cache_salt": self.cache_salt,
                "messages": None if self.messages is None else list(self.messages),
                "display_name": self.display_name, "created": self.created, "updated": self.updated}


def new_name() -> str:
    return PREFIX + secrets.token_hex(12)


class NamedContents:
    def __init__(self, pins):
        self.pins = pins
        self._items: dict[str, Named] = {}

    def _alive(self, n: Named) -> bool:
        self.pins.expire()
        if n.name in self.pins.expires.get((n.ns, n.tokens), {}):
            return True
        self._items.pop(n.name, None)
        return False

    def check_room(self) -> None:
        """JaxsmolError when MAX_CONTENTS names are held (before a new one's prefill)."""
        for n in list(self._items.values()):
            self._alive(n)
        if len(self._items) >= MAX_CONTENTS:
            raise JaxsmolError(f"{MAX_CONTENTS} cached contents exist: delete some first")

    def add(self, n: Named) -> None:
        """Name a content whose tokens were just pinned with `n.name` as the holder."""
        self._items[n.name] = n

    def restore(self, ns, tokens, record: dict) -> None:
        """A content named again from its disk file's record (its pin made already)."""
        messages = record.get("messages")
        self.add(Named(record["name"], record.get("tenant"), record.get("cache_salt"), ns, tuple(tokens),
                       None if messages is None else tuple(messages), str(record.get("display_name") or ""),
                       float(record.get("created", 0)), float(record.get("updated", 0))))

    def get(self, name: str, tenant: str | None) -> Named | None:
        """The tenant's live content `name` (with or without PREFIX), else None."""
        n = self._items.get(name if name.startswith(PREFIX) else PREFIX + name)
        return n if n is not None and n.tenant == tenant and self._alive(n) else None

    def listing(self, tenant: str | None) -> list[Named]:
        """The tenant's live contents, the newest first."""
        mine = [n for n in list(self._items.values()) if n.tenant == tenant and self._alive(n)]
        return sorted(mine, key=lambda n: (-n.created, n.name))

    def expires_at(self, n: Named) -> float:
        """When `n` expires, in seconds since the epoch (now, if it has meanwhile)."""
        at = self.pins.expires.get((n.ns, n.tokens), {}).get(n.name, self.pins.clock())
        return time.time() + max(at - self.pins.clock(), 0.0)

    def set_ttl(self, n: Named, ttl_s: float) -> Named:
        """`n` kept `ttl_s` seconds from now (sooner or later than before)."""
        n = dataclasses.replace(n, updated=time.time())
        self._items[n.name] = n
        self.pins.set_expiry(n.ns, n.tokens, n.name, ttl_s, n.record())
        return n

    def delete(self, n: Named) -> None:
        """Forget `n`: its hold released (the prefix unpinned unless another hold keeps it)."""
        self._items.pop(n.name, None)
        self.pins.release(n.ns, n.tokens, n.name)

    def by_key(self) -> dict:
        """(namespace, tokens) -> the names holding it (GET /v1/cache's entries show them)."""
        out: dict = {}
        for n in list(self._items.values()):
            if self._alive(n):
                out.setdefault((n.ns, n.tokens), []).append(n.name)
        return out
