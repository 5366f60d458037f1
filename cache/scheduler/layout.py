"""The decode rows and their KV batch: which row holds which choice, the batch's width and capacity, and
moving the live rows when it grows or shrinks (the scheduler's docstring says when)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cache.scheduler.state import Row, SchedulerStats
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime import programs
from jaxsmol.runtime.batch import empty_batch

SHRINK_AFTER = 8  # decode steps at a smaller width's occupancy before the batch is compacted


class DecodeRows:
    def __init__(self, engine, settings: BatchSettings, kv_bytes_per_token: int, stats: SchedulerStats):
        """kv_bytes_per_token: a decode row's bytes per position (its draft cache's included)."""
        self.engine, self.settings, self.stats = engine, settings, stats
        self.kv_bytes_per_token = kv_bytes_per_token
        self.rows: list[Row | None] = []
        self.batch: KVCache | None = None  # k, v [L, W, K, S, H], pos [W]
        self.spare: KVCache | None = None  # an idle bigger batch (see Scheduler.kv_bytes_held)
        self.shrink_votes = 0

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    def insert(self, rows: list[Row], kv: KVCache, waiting: int) -> None:
        """Write the prompt state `kv` [L, 1, K, S, H] into one free decode row per choice (`waiting`:
        the choices of the requests still to come in)."""
        live = self.live
        needed, held = live + len(rows), len(self.rows) if live else 0  # idle: any shape
        width = self.settings.width_for(needed)
        capacity = max(kv.capacity, self.batch.capacity if held else 0)
        if not held or width > held or capacity > self.batch.capacity:
            self.relayout(max(self.grown_width(needed, capacity, waiting), held), capacity)
        free = [i for i, r in enumerate(self.rows) if r is None]  # admission left room for all
        for row, i in zip(rows, free):
            self.rows[i] = row
            self.batch = programs.insert_row(self.batch, kv, np.int32(i))

    def grown_width(self, needed: int, capacity: int, waiting: int) -> int:
        """The width a batch grows to for `needed` rows: room for the `waiting` choices too, as far as
        kv_bytes allows, so that a burst of requests moves the batch once rather than at every rung of
        the ladder (each move copies every live row; growing 8 -> 16 rows at 512 slots: ~0.15 s)."""
        s = self.settings
        least, most = s.width_for(needed), s.width_for(needed + waiting)
        fits = [w for w in s.widths if least <= w <= most and w * capacity * self.kv_bytes_per_token <= s.kv_bytes]
        return max(fits, default=least)

    def relayout(self, width: int, capacity: int) -> None:
        """Move the live rows (compacted to the front) into a batch of `width` rows x `capacity` slots
        (with none live: the idle batch or the spare where one has that shape)."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        rows = [self.rows[i] for i in live] + [None] * (width - len(live))
        old, self.batch = self.batch, None
        fits = [b for b in (old, self.spare) if b is not None and (b.rows, b.capacity) == (width, capacity)]
        reuse = fits[0] if fits and not live else None
        if reuse is None or reuse is self.spare:
            self.spare = None  # one not reused is freed before the new batch is made: its memory, not fresh pages
        new_bytes = width * capacity * self.engine.kv_bytes_per_token
        if old is not None and old is not reuse and new_bytes < old.nbytes <= self.settings.kv_bytes - new_bytes:
            self.spare = old  # a bigger batch kept for the next burst (see Scheduler.kv_bytes_held)
        if reuse is not None:
            self.batch = reuse.replace(pos=jnp.zeros_like(reuse.pos))  # no row reads past its pos
        elif not live:
            old = None  # freed before the new one is made (unless kept as the spare)
            self.batch = empty_batch(self.engine.cfg, width, capacity, self.engine.cache_dtype, self.engine.mesh)
        else:
            source = jnp.asarray(live + [-1] * (width - len(live)), jnp.int32)
            self.batch = programs.relayout(old, source, width, capacity)
        self.rows = rows
        self.stats.relayouts += 1
        self.shrink_votes = 0

    def maybe_shrink(self) -> None:
        """Compact the live rows into the narrowest width that holds them, after SHRINK_AFTER steps in a
        row at most half used (an idle batch is kept as it is, for the next burst)."""
        live = self.live
        if self.batch is None or live == 0:
            return
        target = self.settings.width_for(live)
        self.shrink_votes = self.shrink_votes + 1 if target <= len(self.rows) // 2 else 0
        if self.shrink_votes >= SHRINK_AFTER:
            self.relayout(target, self.batch.capacity)
