"""Buffers an engine keeps between requests, because fresh memory of their size costs page faults.

- `CachePool`: finished one-row device caches, by capacity. A finished request's cache can serve the
  next request of the same capacity: its stale slots are never read (kv.py), and a buffer XLA already
  owns skips the page faults of a fresh allocation (~35 ms for 2048 slots here, ~250 ms for 4096).
- `StagingBuffers`: restore's two host buffers (keys, values), which a snapshot's prefix is copied
  through on its way to the device (47 MB: ~60 ms fresh, ~7 ms reused), keys and values at once.

Both are counted (`nbytes`, the daemon's `jaxsmol_pool_bytes`) and bounded (see each class).
"""

from __future__ import annotations

import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np

from jaxsmol.model.kv import KVCache, aligned_host_prefix


class CachePool:
    """Finished caches by capacity, at most `limit(nbytes)` each: as many as BYTES_PER_CAPACITY
    holds, between MIN_PER_CAPACITY and PER_CAPACITY. A burst of prompts takes one each (the scheduler
    prefills 8 at once): 8 prompts of 40 tokens reached their first tokens in 498-521 ms with 8 kept
    against 538-612 ms with 2. So the pool holds at most max(2 buffers, 192 MiB) a capacity.

    The engine marks each cache it makes with the tokens whose exact state its first slots hold
    (`mark`: what an exact prefill of them computes, bits that depend on the tokens alone), and a cache
    comes back with its mark. A restore of a prefix of those tokens takes it as it is (`take_holding`)
    instead of copying the snapshot in: the next turn of a chat, or another request on the same
    prefix, skips the restore's copies (47 MB at 1008 tokens of SmolLM2-135M). Plain takes use one
    holding nothing first, else the oldest. A mark lives as long as the cache's key buffer (a weak
    reference): a buffer donated to the next call leaves its mark behind."""

    PER_CAPACITY, MIN_PER_CAPACITY, BYTES_PER_CAPACITY = 8, 2, 192 * 2**20

    def __init__(self):
        self._free: dict[int, list[tuple[KVCache, tuple]]] = {}  # capacity -> (finished cache, held), oldest first
        self._marks: dict[int, tuple[weakref.ref, tuple]] = {}  # id(kv.k) -> (a weak kv.k, its exact tokens)
        self.taken_holding = 0  # restores that took a cache already holding their prefix (no copy)

    def mark(self, kv: KVCache, tokens=()) -> KVCache:
        """Note that kv's slots 0..len(tokens)-1 hold the exact state of `tokens` (empty: nothing
        known); returns kv."""
        key = id(kv.k)
        if tokens:
            self._marks[key] = (weakref.ref(kv.k, functools.partial(self._forget, key)), tuple(tokens))
        else:
            self._marks.pop(key, None)
        return kv

    def mark_chunk(self, after: KVCache, ids, held: tuple, start: int, n: int, exact_rows: bool) -> None:
        """Mark the cache a prefill chunk of ids[start:start + n] made: it holds ids[:start + n] exactly
        when the chunk's rows are exact (its length an exact bucket) and the cache before it held
        ids[:start] exactly (`held`; or nothing came before)."""
        exact = exact_rows and len(held) >= start and held[:start] == tuple(ids[:start])
        self.mark(after, ids[:start + n] if exact else ())

    def marked(self, kv: KVCache) -> tuple:
        """The tokens whose exact state kv's first slots hold, as marked; () when none are known."""
        entry = self._marks.get(id(kv.k))
        return entry[1] if entry is not None and entry[0]() is kv.k else ()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._marks.get(key)
        if entry is not None and entry[0] is ref:  # not a newer buffer that took the same id
            del self._marks[key]

    def limit(self, nbytes: int) -> int:
        """How many finished caches of nbytes each are kept for their capacity."""
        return max(self.MIN_PER_CAPACITY, min(self.PER_CAPACITY, self.BYTES_PER_CAPACITY // nbytes))

    def give(self, kv: KVCache) -> None:
        """Keep kv, with its mark, for a later take (the caller must drop its reference); the oldest
        goes when its capacity is full."""
        free = self._free.setdefault(kv.capacity, [])
        free.append((kv, self.marked(kv)))
        if len(free) > self.limit(kv.nbytes):
            free.pop(0)

    def take(self, capacity: int) -> KVCache | None:
        """A kept cache of this capacity, empty (pos 0; its stale slots are never read), or None: one
        holding nothing reusable if there is one, else the oldest."""
        free = self._free.get(capacity)
        if not free:
            return None
        i = next((i for i, (_, held) in enumerate(free) if not held), 0)
        return self.mark(free.pop(i)[0].replace(pos=jnp.zeros((), jnp.int32)))

    def take_holding(self, capacity: int, tokens: tuple) -> KVCache | None:
        """A kept cache of this capacity whose slots hold the exact state of `tokens` (a prefix of what
        it came back with), with pos = len(tokens); None if none does."""
        free = self._free.get(capacity, [])
        for i in reversed(range(len(free))):
            kv, held = free[i]
            if len(held) >= len(tokens) and held[:len(tokens)] == tokens:
                del free[i]
                self.taken_holding += 1
                return self.mark(kv.replace(pos=jnp.asarray(len(tokens), jnp.int32)), tokens)
        return None

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for free in list(self._free.values()) for kv, _ in list(free))


class StagingBuffers:
    """Two host buffers (0: keys, 1: values), each grown to the largest restored prefix's k or v and
    kept. One restore at a time uses them: hold `lock` until the device has read them."""

    def __init__(self):
        self.raw = [np.empty(0, np.uint8)] * 2
        self.lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None  # copies the keys while the caller copies the values

    def stage(self, k: np.ndarray, v: np.ndarray, n: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n positions of host k and v, each in its buffer (kv.aligned_host_prefix), copied
        on two threads (NumPy lets go of the GIL while it copies): a 1008-position prefix of
        SmolLM2-135M, 2 x 24 MB, took 5.5-6 ms on one thread. Call with `lock` held."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="jaxsmol-staging")
        keys = self._helper.submit(aligned_host_prefix, k, n, multiple, lambda size: self.buffer(0, size))
        values = aligned_host_prefix(v, n, multiple, lambda size: self.buffer(1, size))
        return keys.result(), values

    def buffer(self, i: int, nbytes: int) -> np.ndarray:
        """Host buffer i of at least nbytes."""
        if self.raw[i].nbytes < nbytes:
            self.raw[i] = np.empty(nbytes, np.uint8)
        return self.raw[i]

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for raw in self.raw)
