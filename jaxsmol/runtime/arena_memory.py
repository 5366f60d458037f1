"""The KV arena's pages (jaxsmol/runtime/kv_arena.py), a part of `KVArena` apart only to keep each file
short: handing rows' pages back to the OS (a row's tail past what its sequence may use, whole free rows,
the least recently used first) and counting what is written and resident. On CPU the arena is this
process's memory, allocated without touching it: a page is backed when first written (see kv_arena.py).
Its methods use the arena's `shape`, `dtype`, `host`, `kernel`, `_base`, `_views`, `_free`, `touched`,
`exact`, `tags`, `pos`, `k`, `v` and `lock`.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import numpy as np

from jaxsmol.system import host_memory


def locked(method):
    """The method under the arena's lock: each program call reads k and v and replaces them (they are
    donated), so two threads using one engine's arena (a library's) take turns, call by call."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class ArenaMemory:
    def _trim(self, row: int, keep: int) -> None:
        """Hand back the pages of `row` past its first `keep` slots (each kv head's slab of each layer)."""
        if not self.host:
            return
        jax.block_until_ready((self.k, self.v))  # no program may be writing them meanwhile
        L, R, K, S, H = self.shape
        slab, itemsize = S * H * self.dtype.itemsize, self.dtype.itemsize
        for base in self._base:
            for layer in range(L):
                for kh in range(K):
                    start = base + ((layer * R + row) * K + kh) * slab
                    host_memory.give_back(start + keep * H * itemsize, slab - keep * H * itemsize)
        self.touched[row] = keep
        self.exact[row] = min(self.exact[row], keep)

    @locked
    def release(self, rows) -> int:
        """Hand the pages of these free rows back to the OS (they read as zeros; their exact positions and tags go).
        Returns the bytes handed back (0 where the arena is not this process's memory). A row's kv heads
        are contiguous in each layer, and so are neighbouring rows: the ranges are merged, so that only
        the pages a released range shares with a row still held stay."""
        rows = sorted(r for r in rows if self.touched[r])
        if not rows or not self.host:
            return 0
        jax.block_until_ready((self.k, self.v))  # no program may be writing them meanwhile
        L, R, K, S, H = self.shape
        block = K * S * H * self.dtype.itemsize  # row r of layer l: [(l R + r) block, + block)
        ranges = []
        for base in self._base:
            for layer in range(L):
                for r in rows:
                    start = base + (layer * R + r) * block
                    if ranges and ranges[-1][1] == start:
                        ranges[-1][1] = start + block
                    else:
                        ranges.append([start, start + block])
        for r in rows:
            self.touched[r], self.exact[r], self.tags[r], self.pos[r] = 0, 0, None, 0
        return sum(host_memory.give_back(start, end - start) for start, end in ranges)

    @locked
    def release_free(self, keep_slots: int = 0) -> int:
        """Release free rows, least recently used first, until those left hold at most `keep_slots`
        slots written. Returns the bytes handed back."""
        held = sum(self.touched[r] for r in self._free)
        victims = []
        for r in self._free:
            if held <= keep_slots:
                break
            if self.touched[r]:
                victims.append(r)
                held -= self.touched[r]
        return self.release(victims)

    def slots_held(self, free: bool | None = None) -> int:
        """Slots written (touched) by the rows: all of them, the free ones (True), the taken ones (False)."""
        free_rows = set(self._free)
        return sum(t for r, t in enumerate(self.touched) if free is None or (r in free_rows) == free)

    def host_views(self) -> tuple[np.ndarray, np.ndarray] | None:
        """k and v as NumPy arrays over the arena's own pages, no program writing them meanwhile, where
        the arena is this process's raw memory (the CPU kernels' reserved buffers, which every program
        updates in place); else None. A restore or a read of a row is then one strided copy at memory
        speed, not a program and a staging copy per block."""
        if not (self.host and self.kernel) or not self.check_in_place():
            return None
        jax.block_until_ready((self.k, self.v))
        if self._views is None or self._views[0] != self._base:
            nbytes = self.span_bytes // 2
            self._views = (self._base, tuple(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(base))
                                             .view(self.dtype).reshape(self.shape) for base in self._base))
        return self._views[1]

    @property
    def span_bytes(self) -> int:
        """Bytes k and v span (allocated whole; backed only where written, on CPU)."""
        return 2 * int(np.prod(self.shape)) * self.dtype.itemsize

    def resident_bytes(self) -> int:
        """The arena's memory now: its resident pages (mincore) where it is this process's memory, else
        all of it (device memory allocated whole)."""
        if not self.host:
            return self.span_bytes
        nbytes = self.span_bytes // 2
        return sum(host_memory.resident_in(base, nbytes) or 0 for base in self._base)

    def check_in_place(self) -> bool:
        """Whether the arena is still the buffers it was allocated as (every program updated it in place)."""
        return not self.host or (self.k.unsafe_buffer_pointer(), self.v.unsafe_buffer_pointer()) == self._base
