"""The one interface `PrefixCache` holds its store by (`Hit`, the methods below), and the radix store behind it.

Two stores implement it: `RadixPrefixStore` (many keys in a radix tree, cache/store/radix.py) and
`SingleSnapshotStore` (the single snapshot of the course exercise, cache/store/minimal.py). Neither knows
anything about models: a value is a pytree of host arrays whose leaves share a sequence axis (for
jaxsmol, {"k", "v"} segments of the KV cache), plus an optional payload per stored key (for jaxsmol,
the logits after the key's last token, which answer an identical prompt with no forward).

    lookup(ns, tokens, gather=True, count=True) -> Hit   the longest stored prefix, held until release(hit.lease)
                                  (gather=False: its value read later, by gather(hit.lease, hit.reused);
                                  count=False: not a request's hit, e.g. an answer extending its prompt)
    peek(ns, tokens) -> int       how many leading tokens are stored (nothing gathered, held or touched)
    insert(ns, tokens, value_of, payload=None) -> positions newly stored
    state(ns, tokens) -> (tokens, value, {length: payload}) of the longest stored prefix, or None
    add(ns, tokens, value_of, payloads)   store a key and an exact entry per payload (files, disk)
    entries() -> [(ns, tokens)]   every stored key, least recently used first
    clear(), bytes_held, evictions, keeps_last_position, max_keys
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsmol.cache.store.radix import RadixStore


@dataclasses.dataclass
class Hit:
    """What a lookup found for a prompt of n tokens."""
    matched: int  # prompt tokens found in the store
    reused: int  # positions to restore: matched, capped at n - 1 unless `payload` (an exact full hit)
    value: Any = None  # the state of (at least) the first `reused` positions; None when reused == 0
    payload: Any = None  # stored with a key equal to the whole prompt
    nearest_len: int = 0  # the length of the nearest stored key (miss diagnostics)
    lease: Any = None  # what `release` unpins (None: nothing pinned)


class RadixPrefixStore(RadixStore):
    """The radix store, behind the store interface."""
    keeps_last_position = True  # a whole prompt is stored, with its last logits as the payload
    max_keys = None

    def lookup(self, namespace, tokens, gather: bool = True, count: bool = True) -> Hit:
        """gather=False leaves hit.value None: `gather(hit.lease, hit.reused)` reads it later, while
        the lease holds it (a copy the caller may not need yet). count: a hit on every node whose
        positions are all restored (what inspection reports per entry)."""
        match = self.match(namespace, tokens)
        n = len(tokens)
        exact = match.payload is not None
        reused = n if exact else min(match.length, n - 1)
        hit = Hit(matched=match.length, reused=reused, payload=match.payload, nearest_len=match.nearest_len)
        if reused:
            self.acquire(match)
            hit.lease = match
            hit.value = self.gather(match, reused) if gather else None
            depth = 0
            for node in match.path if count else ():
                depth += len(node.tokens)
                node.hits += depth <= reused
        return hit

    def release(self, lease) -> None:
        if lease is not None:  # a lookup that restored nothing pinned nothing
            super().release(lease)

    def state(self, namespace, tokens):
        match = self.match(namespace, tokens)
        if match.length == 0:
            return None
        return self.tokens(match), self.gather(match), self.payloads(match)

    def add(self, namespace, tokens, value_of, payloads: dict) -> None:
        for n in sorted(payloads):  # shorter keys first: each insert stores only what is new
            self.insert(namespace, tokens[:n], value_of, payload=payloads[n])
        self.insert(namespace, tokens, value_of)

    def entries(self) -> list:
        return [(ns, self.tokens(m)) for ns, m in self.keys()]
