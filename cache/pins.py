"""Pinned prefixes: stored keys of the radix store kept out of LRU eviction, under a budget of their own.

`PrefixCache` holds a `Pins` as `cache.pins`. A pin is a key of the radix store (a namespace and its
token ids) whose nodes are never evicted (cache/store/pinned_keys.py `pin`); their bytes are counted as
`held` (the store's `pinned_bytes`) against `budget_bytes` (the daemon's `--pinned-bytes`), not against
the LRU budget. `unpin` returns a key to the LRU. With a disk tier each pin is written there at once
as a snapshot marked pinned (cache/store/snapshot.py), and `PrefixCache.warm_from_disk` pins those
again at start; an unpinned key's file is deleted (it is written again if it is spilled or persisted).

A pin may expire (`pin(..., ttl_s=...)`, and `keep`: a request's cache breakpoints, the Messages API's
`cache_control`): it is kept exactly that long from its last pin, then `expire` returns it to the LRU;
pinning it again with a TTL extends it, without one makes it lasting. Its bytes count against the same
budget. An expiring pin has holders, each with its own expiry: `None` for cache breakpoints (a later one
extends it), a name for a named cached content (cache/named.py: `set_expiry` moves it either way,
`release` drops it); the key stays pinned until its last holder's expiry. A named pin is written to the
disk tier with its expiry and record (a restart pins it again for what is left of its TTL); a
breakpoint's is not.

A pin changes where a prefix is kept, never its bits: a request restores a pinned prefix exactly as
any other stored one.
"""

from __future__ import annotations

import dataclasses
import time

from jaxsmol.cache.store.disk import SnapshotError
from jaxsmol.errors import JaxsmolError

DEFAULT_BUDGET_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class Pinned:
    """What pinning a key did."""
    tokens: int  # the key's length
    added_bytes: int  # bytes newly counted as pinned (0: pinned already, or its nodes were)
    held_bytes: int  # every pinned key's bytes afterwards
    on_disk: bool  # written to the disk tier as a pinned snapshot


class Pins:
    def __init__(self, cache, budget_bytes: int = DEFAULT_BUDGET_BYTES, clock=time.monotonic):
        """clock: seconds, what expiries are measured on (a test passes one it moves by hand)."""
        if budget_bytes < 0:
            raise JaxsmolError(f"pinned budget must be >= 0 bytes, got {budget_bytes}")
        self.cache, self.budget_bytes, self.clock = cache, int(budget_bytes), clock
        self.restored, self.warnings = 0, []  # pins restored from the disk tier at start, and those that were not
        self.lasting: set[tuple] = set()  # (namespace, tokens) of the pins that last until `unpin`
        # (namespace, tokens) of each held pin -> {holder: when its hold expires (on `clock`)}
        self.expires: dict[tuple, dict] = {}
        self._soonest = float("inf")  # at most the earliest key's expiry: `expire` is a comparison until then

    @property
    def held(self) -> int:
        return self.cache.store.pinned_bytes

    def keys(self, lasting: bool = False) -> list[tuple]:
        """(namespace, tokens) of every pinned key (lasting: of those that do not expire)."""
        keys = self.lasting if lasting else self.cache.store.pinned
        return sorted(keys, key=lambda k: (str(k[0]), k[1]))

    def is_pinned(self, ns, tokens, lasting: bool = False) -> bool:
        key = (ns, tuple(tokens))
        return key in (self.lasting if lasting else self.cache.store.pinned)

    def check(self, lk) -> None:
        """Before a prompt is prefilled to be pinned: JaxsmolError if it cannot be, naming why (the
        cache's mode, a bypass, or a budget its positions not pinned yet would exceed)."""
        cache = self.cache
        self.expire()
        if cache.mode != "radix":
            raise JaxsmolError("pinning needs the radix prefix cache (--cache-mode radix, the prefix cache on)")
        if lk.report.bypass is not None:
            raise JaxsmolError(f"cannot pin this prompt: {lk.report.bypass}")
        if self.is_pinned(lk.ns, lk.prompt):
            return
        covered = 0  # leading positions already on pinned nodes
        for node in cache.store.match(lk.ns, lk.prompt, touch=False).path:
            if not node.pins:
                break
            covered += len(node.tokens)
        least = max(len(lk.prompt) - covered, 0) * cache.bytes_per_token + 4 * cache.engine.cfg.vocab_size
        self._refuse_over_budget(len(lk.prompt), least)

    def _refuse_over_budget(self, n: int, cost: int) -> None:
        if self.held + cost > self.budget_bytes:
            raise JaxsmolError(f"cannot pin {n} tokens: they need {cost:,} more bytes and the pinned prefixes "
                               f"hold {self.held:,} of the pinned budget (--pinned-bytes) of {self.budget_bytes:,} "
                               "bytes; unpin some or raise --pinned-bytes")

    def expiry(self, ns, tokens) -> float | None:
        """When an expiring pin's last hold expires (on `clock`); None for a lasting pin or none."""
        key = (ns, tuple(tokens))
        holds = self.expires.get(key)
        return max(holds.values()) if holds and key not in self.lasting else None

    def pin(self, ns, tokens, write: bool = True, ttl_s: float | None = None, holder: str | None = None,
            record: dict | None = None) -> Pinned:
        """Pin the stored key `tokens` (a stored prompt or any prefix of one) of namespace `ns`
        (JaxsmolError if it is not stored or would exceed the budget). Without `ttl_s` the pin lasts
        until `unpin`, and with a disk tier and `write` it is written there marked pinned; with it, the
        pin is held `ttl_s` seconds from now by `holder` (None: a breakpoint's hold, extended by a later
        one; a lasting pin stays lasting, its holds kept), and a named holder's pin is written with its
        `record` (a lasting one's file stays as it is)."""
        store, key = self.cache.store, (ns, tuple(tokens))
        self.expire()
        cost = store.pin_cost(*key)
        if cost is None:
            raise JaxsmolError(f"cannot pin {len(tokens)} tokens: they are not stored (evicted meanwhile?)")
        self._refuse_over_budget(len(tokens), cost)
        store.pin(*key)
        on_disk = False
        if ttl_s is None:
            self.lasting.add(key)
            on_disk = write and self.write(*key)
        else:
            holds, until = self.expires.setdefault(key, {}), self.clock() + ttl_s
            holds[holder] = until if holder is not None else max(holds.get(None, 0.0), until)
            self._soonest = min(self._soonest, until)
            on_disk = write and holder is not None and key not in self.lasting and self.write(*key, ttl_s, record)
        self.cache.sync()
        return Pinned(len(tokens), cost, self.held, on_disk)

    def set_expiry(self, ns, tokens, holder: str, ttl_s: float, record: dict | None = None) -> bool:
        """Move `holder`'s expiry of an expiring pin to `ttl_s` seconds from now (rewriting its disk
        file's); False if it holds no such pin."""
        key = (ns, tuple(tokens))
        if holder not in self.expires.get(key, {}):
            return False
        self.expires[key][holder] = self.clock() + ttl_s
        self._soonest = min(self._soonest, self.expires[key][holder])
        if key not in self.lasting:
            self.write(*key, ttl_s, record)
        return True

    def release(self, ns, tokens, holder: str) -> bool:
        """Drop `holder`'s hold on an expiring pin (its key unpinned when no hold is left); False if it
        had none."""
        key = (ns, tuple(tokens))
        holds = self.expires.get(key, {})
        if holder not in holds:
            return False
        del holds[holder]
        if not holds:
            del self.expires[key]
            if key not in self.lasting:
                self.unpin(*key)
        return True

    def keep(self, ns, prompt, breakpoints, read: int) -> int:
        """Pin a stored prompt's cache breakpoints, each (position, ttl_s): its first `position` tokens
        for ttl_s seconds. A breakpoint the budget refuses is left out (the request is served all the
        same). Returns the positions newly kept past the `read` restored ones: the furthest breakpoint
        whose pin added bytes (a new pin, or one reaching past the pinned nodes), less `read`."""
        if self.cache.mode != "radix" or ns is None:
            return 0
        kept = 0
        for position, ttl_s in sorted(breakpoints):
            if not 0 < position <= len(prompt):
                continue
            try:
                pinned = self.pin(ns, prompt[:position], write=False, ttl_s=ttl_s)
            except JaxsmolError:  # over the pinned budget, or evicted meanwhile
                continue
            if pinned.added_bytes:
                kept = max(kept, position)
        return max(kept - read, 0)

    def expire(self) -> int:
        """Return every pin whose expiry has passed to the LRU (evictable again: its entry stays while the
        budget allows); how many."""
        now = self.clock()
        if now < self._soonest:
            return 0
        due = [key for key, holds in self.expires.items() if max(holds.values()) <= now]
        returned = 0
        for key in due:
            del self.expires[key]  # a lasting pin's holds end, the pin stays
            if key not in self.lasting:
                returned += self.unpin(*key)
        self._soonest = min((max(h.values()) for h in self.expires.values()), default=float("inf"))
        self.cache.sync()
        return returned

    def unpin(self, ns, tokens) -> bool:
        """Return a pinned key to the LRU (and delete its pinned file), its holds dropped; False if it was
        not pinned."""
        self.expires.pop((ns, tuple(tokens)), None)
        self.lasting.discard((ns, tuple(tokens)))
        if not self.cache.store.unpin(ns, tuple(tokens)):
            return False
        if self.cache.disk is not None:
            try:
                self.cache.disk.forget(ns[1], tokens)
            except OSError:
                pass
        self.cache.sync()
        return True

    def write(self, ns, tokens, ttl_s: float | None = None, record: dict | None = None) -> bool:
        """Write a pinned key to the disk tier as a snapshot marked pinned (expiring `ttl_s` seconds from
        now, with a named content's `record`); False without one (or on a full or broken disk, which
        costs the file, never the pin)."""
        cache = self.cache
        if cache.disk is None:
            return False
        snap = cache.snapshot_of(tokens, salt=ns[1])
        if snap is None or snap.length != len(tokens):
            return False
        snap.pinned, snap.record = True, record
        snap.expires_at = None if ttl_s is None else time.time() + ttl_s
        try:
            return cache.disk.put(snap)
        except OSError:
            return False

    def restore(self, entries) -> tuple[int, list[str]]:
        """Load the disk tier's pinned entries and pin them again (oldest first), while the budget
        allows, an expiring one for what is left of its TTL (its file deleted once that has passed, its
        record handed to cache.named); returns (how many were pinned, a warning for each one that was
        not)."""
        cache, pinned, warnings = self.cache, 0, []
        for e in sorted(entries, key=lambda e: e.last_used):
            left = None if e.expires_at is None else e.expires_at - time.time()
            if left is not None and (left <= 0 or not e.record):
                cache.disk.forget(e.salt, e.tokens)
                continue
            try:
                snap = cache.disk.load(e)
            except SnapshotError as err:
                warnings.append(f"pinned entry {e.key} not loaded: {err}")
                continue
            cache.add_snapshot(snap)
            cache.stats.disk_loads += 1
            try:
                ns = cache.namespace(snap.salt)
                if left is None:
                    self.pin(ns, snap.tokens, write=False)
                else:
                    self.pin(ns, snap.tokens, write=False, ttl_s=left, holder=e.record["name"])
                    cache.named.restore(ns, snap.tokens, e.record)
                pinned += 1
            except JaxsmolError as err:
                warnings.append(f"pinned entry {e.key} loaded as an ordinary entry: {err}")
        return pinned, warnings
