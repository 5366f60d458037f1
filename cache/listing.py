"""What the prefix cache holds, for an operator (the daemon's GET /v1/cache): its namespaces, and its
entries with their token counts, bytes, hits, last use, pinned flag, the names of the cached contents
holding them and when their pin expires (seconds since the epoch; None for a lasting pin or none), the
largest first, a page at a time.

An entry is a stored key: a prompt (or prompt + answer) whose last logits are kept, or a leaf of the
radix tree. Its `bytes` are its whole state's (every position's keys and values, and its logits), so
entries sharing a trunk each count it; a namespace's `bytes` are what the tree holds for it, each
trunk once. `key` is the entry's name in the disk tier too (cache/store/disk.py `entry_key`).
A namespace is the tenant's (cli/server/tenants.py: "key:..." or "ns:NAME", "default" without API
keys) and its `cache_salt` within it.
"""

from __future__ import annotations

import time

from jaxsmol.cache.store.disk import entry_key
from jaxsmol.cache.store.snapshot import identity
from jaxsmol.errors import JaxsmolError

MAX_LIMIT = 1000


def split_salt(salt: str) -> tuple[str, str | None]:
    """(tenant namespace, cache_salt) of a cache namespace's salt (the daemon joins them with NUL)."""
    tenant, sep, rest = salt.partition("\x00")
    if not sep:
        return "default", salt or None
    return tenant, rest or None


def _entries(cache) -> list[dict]:
    pinned, names, pins = cache.store.pinned, cache.named.by_key(), cache.pins
    now, clock = time.time(), pins.clock()
    out = []
    for ns, tokens, node, nbytes in cache.store.walk():
        if ns[0] != cache.engine.fingerprint:
            continue
        expiry = pins.expiry(ns, tokens)
        out.append({"ns": ns, "tokens": tokens, "bytes": nbytes, "hits": node.hits,
                    "last_used": round(node.used_at, 3) if node.used_at else None, "pinned": (ns, tokens) in pinned,
                    "names": names.get((ns, tokens), []),
                    "expires_at": None if expiry is None else round(now + expiry - clock, 3)})
    return out


def _namespaces(cache, entries: list[dict]) -> list[dict]:
    held: dict = {}
    for ns, _, node, _ in cache.store.walk(keys_only=False):
        b = held.setdefault(ns, [0, 0])
        b[0] += node.nbytes
        b[1] += node.nbytes if node.pins else 0
    counts: dict = {}
    for e in entries:
        counts[e["ns"]] = counts.get(e["ns"], 0) + 1
    out = []
    for ns, n in counts.items():
        tenant, salt = split_salt(ns[1])
        nbytes, pinned = held[ns]
        out.append({"namespace": tenant, "cache_salt": salt, "entries": n, "bytes": nbytes, "pinned_bytes": pinned})
    return sorted(out, key=lambda d: (-d["bytes"], d["namespace"], d["cache_salt"] or ""))


def listing(cache, limit: int = 100, offset: int = 0) -> dict:
    """The cache's namespaces and one page of its entries, largest first (JaxsmolError for a bad page)."""
    if not 1 <= limit <= MAX_LIMIT:
        raise JaxsmolError(f"limit must be in [1, {MAX_LIMIT}], got {limit}")
    if offset < 0:
        raise JaxsmolError(f"offset must be >= 0, got {offset}")
    ident = identity(cache.engine)
    entries = _entries(cache)
    namespaces = _namespaces(cache, entries)
    entries.sort(key=lambda e: (-e["bytes"], -len(e["tokens"]), str(e["ns"][1]), e["tokens"]))
    page = []
    for e in entries[offset:offset + limit]:
        tenant, salt = split_salt(e["ns"][1])
        page.append({"key": entry_key(ident, e["ns"][1], e["tokens"]), "namespace": tenant, "cache_salt": salt,
                     "tokens": len(e["tokens"]), "bytes": e["bytes"], "hits": e["hits"],
                     "last_used": e["last_used"], "pinned": e["pinned"], "names": e["names"],
                     "expires_at": e["expires_at"]})
    out = {"mode": cache.mode, "bytes": cache.bytes_held, "budget_bytes": cache.budget_bytes,
           "pinned_bytes": cache.pins.held, "pinned_budget_bytes": cache.pins.budget_bytes,
           "namespaces": namespaces, "total": len(entries), "offset": offset, "limit": limit, "entries": page}
    if cache.disk is not None:
        d = cache.disk
        out["disk"] = {"dir": str(d.dir), "entries": len(d), "bytes": d.bytes_held, "budget_bytes": d.budget_bytes,
                       "pinned_entries": sum(e.pinned for e in d.entries.values())}
    return out


def find_pinned(cache, key: str):
    """(namespace, tokens) of the pinned key named `key` (as listing() names it), or None."""
    ident = identity(cache.engine)
    return next(((ns, tokens) for ns, tokens in cache.pins.keys() if entry_key(ident, ns[1], tokens) == key), None)
