"""What the prefix cache records: its statistics, its report on one request, what a lookup pins, and a
request's order to pin its prompt.

Plain data shared by cache/prefix_cache.py (which fills them) and cache/scheduler/scheduler.py (which carries a
`Lookup` from admission to the end of a request and an `AnswerSave` until the answer is stored).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from jaxsmol.cache.store.nodes import Match


@dataclasses.dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    exact_hits: int = 0
    misses: int = 0
    bypasses: Counter = dataclasses.field(default_factory=Counter)
    saves: int = 0
    restores: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    bytes_held: int = 0
    pinned_bytes: int = 0  # bytes of pinned prefixes (part of bytes_held; bounded by their own budget)
    evictions: int = 0
    device_hits: int = 0  # rows taken holding (part of) their stored prefix already (cache/device_rows.py)
    device_tokens: int = 0  # positions such rows held: restored with no copy
    disk_loads: int = 0  # entries brought back from the disk tier
    disk_writes: int = 0  # entries written to the disk tier
    disk_refused: Counter = dataclasses.field(default_factory=Counter)  # disk files refused (deleted), by reason
    disk_bytes: int = 0  # bytes held by the disk tier
    shared_loads: int = 0  # prefixes brought from the shared store (--shared-cache)
    shared_hits: int = 0  # chunks read from it and used
    shared_misses: int = 0  # chunk reads that found nothing (the server unreachable included)
    shared_writes: int = 0  # chunks written to it
    shared_bytes_read: int = 0
    shared_bytes_written: int = 0
    shared_unavailable: int = 0  # reads and existence checks that found it unreachable
    shared_skipped: int = 0  # lookups that prefilled what it held: reading it was measured slower
    shared_refused: Counter = dataclasses.field(default_factory=Counter)  # values refused (deleted), by reason
    shared_dropped: Counter = dataclasses.field(default_factory=Counter)  # writes not stored, by reason

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):  # asdict rebuilds a Counter from its items, counting them: not that
            if isinstance(getattr(self, f.name), Counter):
                d[f.name] = dict(getattr(self, f.name))
        return d


@dataclasses.dataclass
class CacheReport:
    """What the cache did for one request."""
    mode: str
    prompt_tokens: int
    bypass: str | None = None  # the reason, when the cache was not consulted
    matched: int = 0  # prompt tokens found in the cache
    reused: int = 0  # positions restored (matched, capped at prompt_n - 1 unless an exact hit)
    prefilled: int = 0  # prompt positions computed
    exact_hit: bool = False  # the whole prompt and its logits were stored: no forward before sampling
    nearest_len: int = 0  # on a partial match or miss: the length of the nearest stored sequence
    divergence_pos: int | None = None  # the first position where the prompt and that sequence differ
    saved: int = 0  # positions newly stored by this request
    kept: int = 0  # positions its cache breakpoints newly pinned past those restored (cache/pins.py `keep`)
    snapshot_bytes: int = 0  # bytes of the state restored or saved for this prompt
    disk_loaded: int = 0  # positions brought back from the disk tier for this request
    shared_loaded: int = 0  # the prefix length restored with chunks from the shared store

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Lookup:
    """What `PrefixCache.lookup` found for one prompt: the state to restore and the entries pinned."""
    ns: tuple | None  # (model fingerprint, salt); None for a bypass (nothing looked up or stored)
    prompt: list[int]
    report: CacheReport
    match: Match | None = None  # what the store found, held for this request (None once released)
    parts: list | None = None  # the stored prefix's host segments {"k", "v"}, in order (views of the store's)
    logits: np.ndarray | None = None  # [V] after the whole prompt, on an exact full hit


@dataclasses.dataclass
class AnswerSave:
    """A prompt + answer to store: `tokens`, from the stored prompt's state (read from the store, or a
    row holding it, at its first chunk)."""
    lookup: Lookup
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class PinOrder:
    """A request's order to pin its prompt once stored: lasting (no ttl_s), or held by `holder` for ttl_s
    seconds and written to the disk tier with `record` (a named cached content, cache/named.py)."""
    ttl_s: float | None = None
    holder: str | None = None
    record: dict | None = None
