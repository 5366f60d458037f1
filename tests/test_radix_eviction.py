"""The radix store's eviction from a heap of leaves (cache/store/radix.py) takes the victims a scan of
every leaf would take: the least recently used leaf that is not leased, pinned or protected, one by
one. A store with the scan as its eviction runs the same random operations beside it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxsmol.cache.store.radix import RadixStore


class ScanningStore(RadixStore):
    """The reference: each victim found by scanning every leaf for the least recently used."""

    def _evict(self, protect=frozenset(), room: int = 0) -> None:
        while self.bytes_held + room - self.pinned_bytes > self.budget_bytes:
            candidates = [n for n in self._leaves() if n.leases == 0 and n.pins == 0 and id(n) not in protect]
            if not candidates:
                return
            victim = min(candidates, key=lambda n: n.last_used)
            if self.on_evict is not None:
                self.on_evict(*self._key_of(victim))
            del victim.parent.children[victim.tokens[0]]
            self.bytes_held -= victim.nbytes
            self.evictions += 1
            if victim.parent.parent is None and not victim.parent.children:
                self._drop_root(victim.parent)


def _run(store: RadixStore, seed: int) -> list:
    """Random inserts (shared prefixes, extensions), lookups, leases and pins; returns what was evicted."""
    rng = random.Random(seed)
    evicted = []
    store.on_evict = lambda ns, match: evicted.append((ns, store.tokens(match)))
    value = np.arange(64, dtype=np.float32)
    keys, leases = [], []
    for _ in range(600):
        op = rng.random()
        if op < 0.55 or not keys:
            base = list(rng.choice(keys)) if keys and rng.random() < 0.5 else []
            key = tuple(base[:rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 6))])
            ns = rng.choice("ab")
            payload = np.ones(2, np.float32) if rng.random() < 0.3 else None
            store.insert(ns, key, lambda a, b: value[a:b], payload=payload)
            keys.append(key)
        elif op < 0.75:
            store.match(rng.choice("ab"), rng.choice(keys))
        elif op < 0.85:
            m = store.match(rng.choice("ab"), rng.choice(keys))
            if m.path:
                store.acquire(m)
                leases.append(m)
        elif op < 0.93 and leases:
            store.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.97:
            store.pin(rng.choice("ab"), rng.choice(keys))
        else:
            ns, key = rng.choice(sorted(store.pinned)) if store.pinned else ("a", keys[0])
            store.unpin(ns, key)
    return evicted


@pytest.mark.parametrize("seed", range(12))
def test_the_heap_evicts_what_a_scan_of_every_leaf_evicts(seed):
    heap, scan = RadixStore(budget_bytes=40 * 4), ScanningStore(budget_bytes=40 * 4)
    evicted = _run(heap, seed)
    assert evicted == _run(scan, seed) and len(evicted) > 20
    assert sorted((ns, t) for ns, t, _, _ in heap.walk()) == sorted((ns, t) for ns, t, _, _ in scan.walk())
    assert heap.bytes_held == scan.bytes_held and heap.pinned_bytes == scan.pinned_bytes


def test_clearing_all_but_the_pinned_keys_leaves_them_evictable_once_unpinned():
    store = RadixStore(budget_bytes=10**6)
    value = np.arange(16, dtype=np.float32)
    for key in [(1, 2, 3), (1, 2, 4), (5, 6)]:
        store.insert("a", key, lambda a, b: value[a:b])
    store.pin("a", (1, 2, 3))
    store.clear(keep_pinned=True)
    assert [t for _, t, _, _ in store.walk()] == [(1, 2, 3)]
    store.unpin("a", (1, 2, 3))
    store.budget_bytes = 0
    store._evict()
    assert len(store) == 0 and store.bytes_held == 0
