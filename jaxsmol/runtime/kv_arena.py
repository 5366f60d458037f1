"""The KV arena: one buffer holding the KV state of every prompt being prefilled and of every decode row,
a row per sequence, which the scheduler takes and gives back.

    k, v: [L, R, K, S, H]   R rows (the last, `pad`, is never handed out: a step's padding entries write
                            there), S slots each: the engine's context, rounded up to ATTN_BLOCK

Why one buffer of whole-context rows: every program over it (batch.py) has one shape whatever the
requests' lengths, so the set of programs a daemon runs is closed once it is ready (a prompt of 3 or of
8000 tokens, a batch of rows of any lengths: the same programs), and nothing is copied between buffers of
other shapes (a prompt is prefilled in the row it decodes in; the batch grows and shrinks by naming
other rows). Its memory is what the rows have written, not R x S: on CPU it is allocated without
touching it (cpu_prefix.cc `Reserve`), a page is backed when first written, and `release` hands a row's
pages back to the OS (host_memory.give_back; that code is arena_memory.py's `ArenaMemory`). This is
vAttention's idea (Prabhu et al., 2024: contiguous virtual memory per request, physical pages on
demand), with the OS's page tables as the page table.
Without the CPU kernels (and on other devices) XLA writes the whole buffer once when it is made; on CPU
its pages are then handed back at once.

Host-side, each row has the position written up to (`pos`), how many of its first positions hold the
state an exact (cold) prefill computes (`exact`: restores and prefills of exact chunks extend it; a
chunk off the exact buckets, a trim or a release lowers it), how far it was written since it was last
released (`touched`: what its pages may hold), and its taker's `tag`. The arena never knows which tokens
a row holds: the prefix cache does. Its radix tree is the one index of prefixes, and a free row is its
device tier: the tag is the tree's spot for the row's tokens (cache/device_rows.py), and a request
restoring a prefix a free row holds takes that row as it is, the restore copying only what it lacks.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import KVCache
from jaxsmol.model.sharding import kv_sharding
from jaxsmol.runtime import programs
from jaxsmol.runtime.arena_handles import Lease, RowView
from jaxsmol.runtime.arena_memory import ArenaMemory, locked
from jaxsmol.runtime.arena_size import arena_shape
from jaxsmol.runtime.batch import BLOCK
from jaxsmol.system import host_memory


class KVArena(ArenaMemory):
    def __init__(self, engine, rows: int):
        """An arena of `rows` rows (plus the pad row) of the engine's context each."""
        cfg = engine.cfg
        self.engine, self.rows, self.pad = engine, rows + 1, rows
        self.shape = arena_shape(cfg, engine.ctx, rows)
        self.slots = self.shape[3]
        self.dtype = np.dtype(engine.cache_dtype)
        self.kernel = cfg.cpu_kernels and engine.mesh is None
        self.host = engine.mesh is None and jax.devices()[0].platform == "cpu"  # its pages are this process's
        self.pos, self.touched, self.exact = [0] * self.rows, [0] * self.rows, [0] * self.rows
        self.tags: list = [None] * self.rows  # the taker's: what the row's positions are (never read here)
        self._free = collections.OrderedDict.fromkeys(range(rows))  # least recently given back first
        self.taken_holding = 0  # takes whose row already held (part of) the prefix to restore
        self._leases: weakref.WeakSet = weakref.WeakSet()
        self.lock = threading.RLock()
        self.k, self.v = self._allocate()
        self._base = (self.k.unsafe_buffer_pointer(), self.v.unsafe_buffer_pointer()) if self.host else None
        self._staging: tuple[np.ndarray, np.ndarray] | None = None
        self._views = None  # (the bases they view, NumPy views of k and v): host_views

    def _allocate(self) -> tuple[jax.Array, jax.Array]:
        if self.engine.mesh is not None:
            sharding = kv_sharding(self.engine.mesh, self.shape)
            return tuple(jnp.zeros(self.shape, self.dtype, device=sharding) for _ in range(2))
        k, v = (programs.reserve(shape=self.shape, dtype=self.dtype, kernel=self.kernel) for _ in range(2))
        if self.host and not self.kernel:  # XLA wrote every zero: its pages go back at once
            for a in jax.block_until_ready((k, v)):
                host_memory.give_back(a.unsafe_buffer_pointer(), a.nbytes)
        return k, v

    @property
    def lost(self) -> bool:
        """Whether its buffers went with a failed program (they were donated to it)."""
        return self.k.is_deleted() or self.v.is_deleted()

    @locked
    def recover(self) -> None:
        """New buffers after a loss: every row free and empty (the leases' rows forgotten)."""
        for lease in list(self._leases):
            lease.rows.clear()
        self.k = self.v = None
        self.k, self.v = self._allocate()
        self._base = (self.k.unsafe_buffer_pointer(), self.v.unsafe_buffer_pointer()) if self.host else None
        self.pos, self.touched, self.exact = [0] * self.rows, [0] * self.rows, [0] * self.rows
        self.tags = [None] * self.rows
        self._free = collections.OrderedDict.fromkeys(range(self.pad))

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one position of one row (keys and values, every layer)."""
        L, _, K, _, H = self.shape
        return 2 * L * K * H * self.dtype.itemsize

    # ---- rows ----------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def free(self) -> list[int]:
        """The free rows, least recently given back first."""
        return list(self._free)

    @locked
    def take(self, row: int | None = None, held: int = 0, expect: int | None = None) -> int:
        """A free row for a new sequence: `row` where the caller chose one (the prefix cache: a row whose
        first `held` positions, exact, are the sequence's own), else one whose pages are backed already
        (holding nothing tagged first, then the least recently used: memory is reused, not grown), else
        an untouched one. Its position is `held`, its tag None (the taker tags it). `expect`: the
        positions the sequence is granted; a row's pages past them (an earlier, longer sequence's) go
        back to the OS, so that a row holds what its sequence may use, not the most any sequence wrote
        in it. JaxsmolError when none is free."""
        if not self._free:
            raise JaxsmolError("no free row in the KV arena")
        if row is None:
            order = {r: i for i, r in enumerate(self._free)}
            row = min(self._free, key=lambda r: (self.touched[r] == 0, self.tags[r] is not None, order[r]))
        elif row not in self._free or held > self.exact[row]:
            raise ValueError(f"row {row} is not free or does not hold {held} exact positions")
        del self._free[row]
        self.taken_holding += held > 0
        self.pos[row], self.exact[row], self.tags[row] = held, min(self.exact[row], held), None
        if expect is not None and self.touched[row] > max(expect, held) + BLOCK:
            self._trim(row, max(expect, held))
        return row

    @locked
    def give(self, row: int) -> None:
        """Hand a row back; what it holds (its pages, exact positions and tag) stays for a later take until
        released."""
        if row in self._free or not 0 <= row < self.pad:
            raise ValueError(f"row {row} is not taken")
        self._free[row] = None

    def lease(self) -> Lease:
        """A holder of rows for one user (a scheduler): what it still holds goes back at `close`."""
        lease = Lease(self)
        self._leases.add(lease)
        return lease

    @contextlib.contextmanager
    def borrowed(self, expect: int | None = None):
        """A row for the duration of a with-block (scoring), `expect` positions of it used (see take)."""
        row = self.take(expect=expect)
        try:
            yield row
        finally:
            self.give(row)

    # ---- the programs ------------------------------------------------------------------------------
    def _kv(self, positions) -> KVCache:
        return KVCache(k=self.k, v=self.v, pos=np.asarray(positions, np.int32))

    def _took(self, k: jax.Array, v: jax.Array) -> None:
        self.k, self.v = k, v

    def next_chunk(self, row: int, ids, T: int) -> tuple[np.ndarray, int, int]:
        """The chunk of T rows (padded) that continues ids in `row`: (tokens [T], real rows, where it
        begins). One that would run past the row's slots begins earlier, recomputing a few positions
        already written: an exact chunk gives every row the same bits wherever it starts."""
        begin = max(min(self.pos[row], self.slots - T), 0)
        n = min(T, len(ids) - begin)
        chunk = np.zeros(T, np.int32)
        chunk[:n] = ids[begin:begin + n]
        return chunk, n, begin

    @locked
    def prefill(self, items: list[tuple[int, list[int]]], T: int, exact_rows: bool, all_logits: bool = False):
        """The next chunk, T rows padded, of each (row, ids) in one forward (ids[pos:] of each row).
        exact_rows: T is an exact bucket (its rows have a cold prefill's bits), so a row holding ids'
        exact state before the chunk holds it after. Returns the logits [P, V] after each chunk's last
        real token ([P, T, V] for every row with all_logits), on the device."""
        chunks = [self.next_chunk(row, ids, T) for row, ids in items]
        tokens = np.stack([c for c, _, _ in chunks])
        lengths = np.array([n for _, n, _ in chunks], np.int32)
        rows = np.array([row for row, _ in items], np.int32)
        logits, kv = programs.prefill_rows(self.engine.params, tokens, lengths, self._kv([b for _, _, b in chunks]),
                                           rows, self.engine.cfg, all_logits=all_logits)
        self._took(kv.k, kv.v)
        for (row, _), (_, n, begin) in zip(items, chunks):
            self.exact[row] = begin + n if exact_rows and self.exact[row] >= begin else min(self.exact[row], begin)
            self.pos[row] = begin + n
            self.touched[row] = max(self.touched[row], begin + T)
        return logits

    def fill(self, row: int, ids: list[int], exact: bool = True):
        """Prefill ids[pos:] into `row`, a chunk at a time (the engine's buckets: exact ones, or the fast
        path's); returns the logits [1, V] after the last."""
        logits = None
        while logits is None or self.pos[row] < len(ids):
            T = self.engine.chunk_rows(len(ids) - self.pos[row], exact=exact)
            logits = self.prefill([(row, ids)], T, exact_rows=T in self.engine.buckets(True))
        return logits

    @locked
    def decode(self, rows: list[int], tokens: np.ndarray, sampling: dict) -> dict:
        """One decode step of `rows` (the pad row for padding entries) with their last tokens [W] and
        sampling arrays (batch.row_settings). Returns the step's output on the host."""
        out, kv = programs.decode_step(self.engine.params, tokens, self._kv([self.pos[r] for r in rows]),
                                       np.asarray(rows, np.int32), sampling, self.engine.cfg)
        self._took(kv.k, kv.v)
        for r in rows:
            if r != self.pad:
                self.pos[r] += 1
                self.touched[r] = max(self.touched[r], self.pos[r])
        return jax.device_get(out)

    @locked
    def verify(self, rows: list[int], tokens: np.ndarray, lengths: np.ndarray, sampling: dict) -> dict:
        """One verify step (batch.verify_step) of `rows`: tokens [W, T] (each row's last token and its
        drafts), lengths [W]. Returns its output on the host; each row's position moves past what it
        accepted."""
        out, kv = programs.verify_step(self.engine.params, tokens, lengths, self._kv([self.pos[r] for r in rows]),
                                       np.asarray(rows, np.int32), sampling, self.engine.cfg)
        self._took(kv.k, kv.v)
        out = jax.device_get(out)
        for i, r in enumerate(rows):
            if r != self.pad:
                self.touched[r] = max(self.touched[r], self.pos[r] + tokens.shape[1])
                self.pos[r] += int(out["count"][i])
        return out

    @locked
    def greedy_drafts(self, row: int, tokens: np.ndarray, length: int, k: int) -> list[int]:
        """A draft model's k greedy tokens after feeding tokens [1, P] (the first `length` real) at the
        row's position (batch.greedy_drafts); the row's position then counts the drafts but the last."""
        drafts, kv = programs.greedy_drafts(self.engine.params, tokens, np.int32(length), self._kv([self.pos[row]]),
                                            np.array([row], np.int32), self.engine.cfg, k=k)
        self._took(kv.k, kv.v)
        self.pos[row] += length + k - 1
        self.touched[row] = max(self.touched[row], self.pos[row] + 1)
        return jax.device_get(drafts).tolist()

    @locked
    def fork(self, source: int, dest: int, n: int | None = None) -> None:
        """Row `dest` (taken) gets the first n positions of `source` (default: all it wrote), and its exact
        positions and tag as far as they go."""
        n = self.pos[source] if n is None else n
        self._took(*programs.copy_row(self.k, self.v, np.int32(source), np.int32(dest), np.int32(n),
                                      kernel=self.kernel))
        self.pos[dest], self.exact[dest], self.tags[dest] = n, min(self.exact[source], n), self.tags[source]
        self.touched[dest] = max(self.touched[dest], n)

    @locked
    def restore(self, row: int, parts, start: int, stop: int, exact: bool = False) -> None:
        """Positions [start, stop) of a stored prefix into `row` (it holds the positions before start):
        `parts` are the prefix's host segments {"k", "v"} [L, 1, K, n_i, H], in order from position 0,
        copied straight into the row's pages where the arena is raw memory (`host_views`), else by
        programs. `exact`: the prefix is the exact state of its tokens (an exact cache's entry)."""
        views = self.host_views()
        offsets = np.cumsum([0] + [p["k"].shape[3] for p in parts])
        if views is None:
            self._write_blocks(row, parts, offsets, start, stop)
        else:  # straight into the row's pages
            for part, p0, p1 in zip(parts, offsets[:-1], offsets[1:]):
                lo, hi = max(start, p0), min(stop, p1)
                if lo < hi:
                    for view, name in zip(views, ("k", "v")):
                        view[:, row, :, lo:hi] = part[name][:, 0, :, lo - p0:hi - p0]
        self.pos[row] = stop
        self.touched[row] = max(self.touched[row], stop if self.kernel else -(-stop // BLOCK) * BLOCK)
        self.exact[row] = stop if exact and self.exact[row] >= start else min(self.exact[row], start)

    def _write_blocks(self, row: int, parts, offsets, start: int, stop: int) -> None:
        """restore's copy by programs: a block of BLOCK slots at a time through staging buffers."""
        kb, vb = self._staging_buffers()
        for b0 in range(start // BLOCK * BLOCK, stop, BLOCK):  # blocks begin at multiples of BLOCK: a whole one fits
            b1 = min(b0 + BLOCK, stop)
            for part, p0, p1 in zip(parts, offsets[:-1], offsets[1:]):
                lo, hi = max(b0, p0), min(b1, p1)
                if lo < hi:
                    kb[:, :, :, lo - b0:hi - b0] = part["k"][:, :, :, lo - p0:hi - p0]
                    vb[:, :, :, lo - b0:hi - b0] = part["v"][:, :, :, lo - p0:hi - p0]
            kb[:, :, :, b1 - b0:] = 0  # finite: masked slots must never hold NaN
            vb[:, :, :, b1 - b0:] = 0
            place = (lambda a: jax.device_put(a, may_alias=True)) if self.host else jax.device_put
            k, v = programs.write_slots(self.k, self.v, place(kb), place(vb), np.int32(row), np.int32(b0),
                                        np.int32(b1 - b0), kernel=self.kernel)
            self._took(*jax.block_until_ready((k, v)))  # read before the staging buffers are refilled

    def _staging_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """Two host blocks [L, 1, K, BLOCK, H] in 64-byte aligned memory (a device_put may then alias them)."""
        if self._staging is None:
            L, _, K, _, H = self.shape
            shape, nbytes = (L, 1, K, BLOCK, H), L * K * BLOCK * H * self.dtype.itemsize

            def aligned():
                raw = np.empty(nbytes + 64, np.uint8)
                offset = (-raw.ctypes.data) % 64
                return raw[offset:offset + nbytes].view(self.dtype).reshape(shape)
            self._staging = (aligned(), aligned())
        return self._staging

    @property
    def staging_bytes(self) -> int:
        """Bytes of the host staging blocks restores copy through (kept between restores)."""
        return 0 if self._staging is None else sum(a.nbytes for a in self._staging)

    @locked
    def segment(self, row: int, start: int, stop: int) -> dict:
        """Positions [start, stop) of `row` as read-only host arrays {"k", "v"} [L, 1, K, stop - start, H]
        (a copy: what the prefix store keeps)."""
        L, _, K, _, H = self.shape
        # pages of their own where large: stored and evicted by the prefix cache, they would fragment malloc's heap
        out = {name: host_memory.empty((L, 1, K, stop - start, H), self.dtype) for name in ("k", "v")}
        views = self.host_views()
        if views is None:
            self._read_blocks(row, start, stop, out)
        else:  # straight from the row's pages
            for view, name in zip(views, ("k", "v")):
                out[name][:, 0] = view[:, row, :, start:stop]
        for a in out.values():
            a.flags.writeable = False
        return out

    def _read_blocks(self, row: int, start: int, stop: int, out: dict) -> None:
        """segment's copy by programs: a block of BLOCK slots at a time."""
        for b0 in range(start // BLOCK * BLOCK, stop, BLOCK):
            lo, hi = max(b0, start), min(b0 + BLOCK, stop)
            blocks = jax.device_get(programs.read_slots(self.k, self.v, np.int32(row), np.int32(b0), np.int32(hi - b0),
                                                        kernel=self.kernel))
            for name, block in zip(("k", "v"), blocks):
                out[name][:, :, :, lo - start:hi - start] = block[:, :, :, lo - b0:hi - b0]

    def view(self, row: int) -> RowView:
        return RowView(self, row)

    def logits_chunks(self, row: int, ids: list[int], T: int):
        """Every position's logits of `ids` prefilled into `row` from position 0 in exact chunks of T rows:
        yields (first position, logits [n, V] NumPy) per chunk (scoring: the whole [len, V] is never held)."""
        self.pos[row], self.exact[row], self.tags[row] = 0, 0, None
        while self.pos[row] < len(ids):
            begin = self.next_chunk(row, ids, T)[2]
            n = min(T, len(ids) - begin)
            logits = self.prefill([(row, ids)], T, exact_rows=True, all_logits=True)
            yield begin, np.asarray(logits)[0, :n]  # sliced on the host: a device slice is a program of its own
