"""Buffers an engine keeps between requests, because fresh memory of their size costs page faults.

- `CachePool`: finished one-row device caches, by capacity. A finished request's cache can serve the
  next request of the same capacity: its stale slots are never read (kv.py), and a buffer XLA already
  owns skips the page faults of a fresh allocation (~35 ms for 2048 slots here, ~250 ms for 4096).
- `StagingBuffers`: restore's two host buffers (keys, values), which a snapshot's prefix is copied
  through on its way to the device (47 MB: ~60 ms fresh, ~7 ms reused), keys and values at once.

Both are counted (`nbytes`, the daemon's `jaxsmol_pool_bytes`) and bounded (see each class).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np

from jaxsmol.model.kv import KVCache, aligned_host_prefix


class CachePool:
    """Finished caches by capacity, at most `limit(nbytes)` each: as many as BYTES_PER_CAPACITY
    holds, between MIN_PER_CAPACITY and PER_CAPACITY. A burst of prompts takes one each (the scheduler
    prefills 8 at once): 8 prompts of 40 tokens reached their first tokens in 498-521 ms with 8 kept
    against 538-612 ms with 2. So the pool holds at most max(2 buffers, 192 MiB) a capacity.

    A cache may come back with the tokens whose exact state its first slots hold (`held`: what an
    exact prefill of them computes, bits that depend on the tokens alone). A restore of a prefix of
    them takes it as it is (`take_holding`) instead of copying the snapshot in: the next turn of a
    chat, or another request on the same prefix, skips the restore's copies (47 MB at 1008 tokens of
    SmolLM2-135M). Plain takes use one holding nothing first, else the oldest."""

    PER_CAPACITY, MIN_PER_CAPACITY, BYTES_PER_CAPACITY = 8, 2, 192 * 2**20

    def __init__(self):
        self._free: dict[int, list[tuple[KVCache, tuple]]] = {}  # capacity -> (finished cache, held), oldest first
        self.taken_holding = 0  # restores that took a cache already holding their prefix (no copy)

    def limit(self, nbytes: int) -> int:
        """How many finished caches of nbytes each are kept for their capacity."""
        return max(self.MIN_PER_CAPACITY, min(self.PER_CAPACITY, self.BYTES_PER_CAPACITY // nbytes))

    def give(self, kv: KVCache, held: tuple = ()) -> None:
        """Keep kv for a later take (the caller must drop its reference); the oldest goes when its
        capacity is full. `held`: the tokens whose exact state slots 0..len(held)-1 hold, if any."""
        free = self._free.setdefault(kv.capacity, [])
        free.append((kv, tuple(held)))
        if len(free) > self.limit(kv.nbytes):
            free.pop(0)

    def take(self, capacity: int) -> KVCache | None:
        """A kept cache of this capacity, empty (pos 0; its stale slots are never read), or None: one
        holding nothing reusable if there is one, else the oldest."""
        free = self._free.get(capacity)
        if not free:
            return None
        i = next((i for i, (_, held) in enumerate(free) if not held), 0)
        return free.pop(i)[0].replace(pos=jnp.zeros((), jnp.int32))

    def take_holding(self, capacity: int, tokens: tuple) -> KVCache | None:
        """A kept cache of this capacity whose slots hold the exact state of `tokens` (a prefix of what
        it came back with), with pos = len(tokens); None if none does."""
        free = self._free.get(capacity, [])
        for i in reversed(range(len(free))):
            kv, held = free[i]
            if len(held) >= len(tokens) and held[:len(tokens)] == tokens:
                del free[i]
                self.taken_holding += 1
                return kv.replace(pos=jnp.asarray(len(tokens), jnp.int32))
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
