"""Pinned prefixes: stored keys of the radix store kept out of LRU eviction, under a budget of their own.

`PrefixCache` holds a `Pins` as `cache.pins`. A pin is a key of the radix store (a namespace and its
token ids) whose nodes are never evicted (cache/store/pinned_keys.py `pin`); their bytes are counted as
`held` (the store's `pinned_bytes`) against `budget_bytes` (the daemon's `--pinned-bytes`), not against
the LRU budget. `unpin` returns a key to the LRU. With a disk tier each pin is written there at once
as a snapshot marked pinned (cache/store/snapshot.py), and `PrefixCache.warm_from_disk` pins those
again at start; an unpinned key's file is deleted (it is written again if it is spilled or persisted).

A pin changes where a prefix is kept, never its bits: a request restores a pinned prefix exactly as
any other stored one.
"""

from __future__ import annotations

import dataclasses

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
    def __init__(self, cache, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if budget_bytes < 0:
            raise JaxsmolError(f"pinned budget must be >= 0 bytes, got {budget_bytes}")
        self.cache, self.budget_bytes = cache, int(budget_bytes)
        self.restored, self.warnings = 0, []  # pins restored from the disk tier at start, and those that were not

    @property
    def held(self) -> int:
        return self.cache.store.pinned_bytes

    def keys(self) -> list[tuple]:
        """(namespace, tokens) of every pinned key."""
        return sorted(self.cache.store.pinned, key=lambda k: (str(k[0]), k[1]))

    def is_pinned(self, ns, tokens) -> bool:
        return (ns, tuple(tokens)) in self.cache.store.pinned

    def check(self, lk) -> None:
        """Before a prompt is prefilled to be pinned: JaxsmolError if it cannot be, naming why (the
        cache's mode, a bypass, or a budget its positions not pinned yet would exceed)."""
        cache = self.cache
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

    def pin(self, ns, tokens, write: bool = True) -> Pinned:
        """Pin the stored key `tokens` of namespace `ns` (JaxsmolError if it is not stored or would
        exceed the budget); with a disk tier and `write`, also write it there marked pinned."""
        store, tokens = self.cache.store, tuple(tokens)
        cost = store.pin_cost(ns, tokens)
        if cost is None:
            raise JaxsmolError(f"cannot pin {len(tokens)} tokens: they are not stored (evicted meanwhile?)")
        self._refuse_over_budget(len(tokens), cost)
        store.pin(ns, tokens)
        on_disk = write and self.write(ns, tokens)
        self.cache.sync()
        return Pinned(len(tokens), cost, self.held, on_disk)

    def unpin(self, ns, tokens) -> bool:
        """Return a pinned key to the LRU (and delete its pinned file); False if it was not pinned."""
        if not self.cache.store.unpin(ns, tuple(tokens)):
            return False
        if self.cache.disk is not None:
            try:
                self.cache.disk.forget(ns[1], tokens)
            except OSError:
                pass
        self.cache.sync()
        return True

    def write(self, ns, tokens) -> bool:
        """Write a pinned key to the disk tier as a snapshot marked pinned; False without one (or on a
        full or broken disk, which costs the file, never the pin)."""
        cache = self.cache
        if cache.disk is None:
            return False
        snap = cache.snapshot_of(tokens, salt=ns[1])
        if snap is None or snap.length != len(tokens):
            return False
        snap.pinned = True
        try:
            return cache.disk.put(snap)
        except OSError:
            return False

    def restore(self, entries) -> tuple[int, list[str]]:
        """Load the disk tier's pinned entries and pin them again (oldest first), while the budget
        allows; returns (how many were pinned, a warning for each one that was not)."""
        cache, pinned, warnings = self.cache, 0, []
        for e in sorted(entries, key=lambda e: e.last_used):
            try:
                snap = cache.disk.load(e)
            except SnapshotError as err:
                warnings.append(f"pinned entry {e.key} not loaded: {err}")
                continue
            cache.add_snapshot(snap)
            cache.stats.disk_loads += 1
            try:
                self.pin(cache.namespace(snap.salt), snap.tokens, write=False)
                pinned += 1
            except JaxsmolError as err:
                warnings.append(f"pinned entry {e.key} loaded as an ordinary entry: {err}")
        return pinned, warnings
