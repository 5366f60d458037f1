"""Buffers an engine keeps between requests, because fresh memory of their size costs page faults.

- `CachePool`: finished one-row device caches, by capacity. A finished request's cache can serve the
  next request of the same capacity: its stale slots are never read (kv.py), and a buffer XLA already
  owns skips the page faults of a fresh allocation (~35 ms for 2048 slots here, ~250 ms for 4096).
- `StagingBuffers`: restore's two host buffers (keys, values), which a snapshot's prefix is copied
  through on its way to the device (47 MB: ~60 ms fresh, ~7 ms reused).

Both are counted (`nbytes`, the daemon's `jaxsmol_pool_bytes`) and bounded (see each class).
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np

from jaxsmol.kv import KVCache


class CachePool:
    """Finished caches by capacity, at most `limit(nbytes)` each: as many as BYTES_PER_CAPACITY
    holds, between MIN_PER_CAPACITY and PER_CAPACITY. A burst of prompts takes one each (the scheduler
    prefills 8 at once): 8 prompts of 40 tokens reached their first tokens in 498-521 ms with 8 kept
    against 538-612 ms with 2. So the pool holds at most max(2 buffers, 192 MiB) a capacity."""

    PER_CAPACITY, MIN_PER_CAPACITY, BYTES_PER_CAPACITY = 8, 2, 192 * 2**20

    def __init__(self):
        self._free: dict[int, list[KVCache]] = {}  # capacity -> finished caches

    def limit(self, nbytes: int) -> int:
        """How many finished caches of nbytes each are kept for their capacity."""
        return max(self.MIN_PER_CAPACITY, min(self.PER_CAPACITY, self.BYTES_PER_CAPACITY // nbytes))

    def give(self, kv: KVCache) -> None:
        """Keep kv for a later take, if its capacity has room (the caller must drop its reference)."""
        free = self._free.setdefault(kv.capacity, [])
        if len(free) < self.limit(kv.nbytes):
            free.append(kv)

    def take(self, capacity: int) -> KVCache | None:
        """A kept cache of this capacity, empty (pos 0; its stale slots are never read), or None."""
        free = self._free.get(capacity)
        return free.pop().replace(pos=jnp.zeros((), jnp.int32)) if free else None

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for free in list(self._free.values()) for kv in list(free))


class StagingBuffers:
    """Two host buffers (0: keys, 1: values), each grown to the largest restored prefix's k or v and
    kept. One restore at a time uses them: hold `lock` until the device has read them."""

    def __init__(self):
        self.raw = [np.empty(0, np.uint8)] * 2
        self.lock = threading.Lock()

    def buffer(self, i: int, nbytes: int) -> np.ndarray:
        """Host buffer i of at least nbytes."""
        if self.raw[i].nbytes < nbytes:
            self.raw[i] = np.empty(nbytes, np.uint8)
        return self.raw[i]

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for raw in self.raw)
