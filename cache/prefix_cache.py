"""The prefix cache in front of the engine: bypass, lookup, restore, continue, save.

Modes:
  "minimal"  the lab's cache: one snapshot of the first prompt_n - 1 tokens (cache/minimal.py)
  "radix"    many prefixes in a radix tree (cache/radix.py), longest match at token granularity,
             the last prompt position's logits kept for an exact full hit (no forward at all),
             generated tokens saved too (the next chat turn repeats them), LRU under a byte budget
  "off"      every request bypasses

Keys are namespaced by the model fingerprint (config, dtype, weights) and an optional salt.

A second tier on disk (`disk=DiskStore(...)`, cache/disk.py), radix mode: evicted entries are written
there while its budget allows, a lookup that finds a longer prefix there than in memory brings it back
first, and `persist_to_disk` / `warm_from_disk` carry the whole store across a restart.
`snapshot_of` / `add_snapshot` move one stored key out of and into the cache, in either mode.

Exactness: a warm run gives the bits of a cold run. Prefill chunks are >= 64 rows wherever they
start (see jaxsmol/engine.py), and the generated tokens' state is saved only after re-prefilling
it the same way (`exact=True`), because single-token decode rows differ from prefill rows in the
last bits on XLA:CPU. With exact=False (the non-bitwise fast path) a short suffix after a restore is
prefilled in 1, 16 or 32 rows instead of 64, and the decode state is saved as is: cheaper, but a
warm run may then differ from a cold one in the last bits (and rarely in a sampled token).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from cache.disk import DiskStore, Snapshot, SnapshotError
from cache.minimal import SingleSnapshotStore
from cache.radix import RadixStore
from jaxsmol.engine import Engine, Generation
from jaxsmol.errors import JaxsmolError
from jaxsmol.kv import SEQ_AXIS, KVCache
from jaxsmol.sampling import SamplingParams

MODES = ("radix", "minimal", "off")


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
    evictions: int = 0
    disk_loads: int = 0  # entries brought back from the disk tier
    disk_writes: int = 0  # entries written to the disk tier
    disk_refused: int = 0  # disk entries that failed verification (dropped)
    disk_bytes: int = 0  # bytes held by the disk tier

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bypasses"] = dict(self.bypasses)
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
    snapshot_bytes: int = 0  # bytes of the state restored or saved for this prompt
    disk_loaded: int = 0  # positions brought back from the disk tier for this request

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PrefixCache:
    def __init__(self, engine: Engine, mode: str = "radix", budget_bytes: int = 2 << 30, salt: str = "",
                 save_generated: bool = True, exact: bool = True, disk: DiskStore | None = None):
        if mode not in MODES:
            raise JaxsmolError(f"cache mode must be one of {', '.join(MODES)}, got {mode!r}")
        if budget_bytes < 0:
            raise JaxsmolError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.engine, self.mode, self.salt = engine, mode, salt
        self.save_generated, self.exact = save_generated, exact
        self.bytes_per_token = engine.kv_bytes_per_token
        self.budget_bytes = budget_bytes
        self.radix = RadixStore(budget_bytes, seq_axis=SEQ_AXIS)
        self.single = SingleSnapshotStore()
        self.stats = CacheStats()
        self.disk = disk if mode != "off" else None
        if self.disk is not None and mode == "radix":
            self.radix.on_evict = self._spill
        engine.fingerprint  # hash the weights now, not inside the first request's time to first token

    # ---- bookkeeping ----------------------------------------------------------------------------
    def namespace(self, salt: str | None = None) -> tuple:
        return (self.engine.fingerprint, self.salt if salt is None else salt)

    @property
    def capacity_tokens(self) -> int:
        """Positions whose state fits the byte budget (radix mode also keeps a prompt's last logits)."""
        logits_bytes = 4 * self.engine.cfg.vocab_size if self.mode == "radix" else 0
        return max(self.budget_bytes - logits_bytes, 0) // self.bytes_per_token

    @property
    def bytes_held(self) -> int:
        return self.radix.bytes_held + self.single.bytes_held

    def flush(self) -> None:
        """Forget every entry, the disk tier's too."""
        self.radix.clear()
        self.single.clear()
        if self.disk is not None:
            self.disk.clear()
        self._sync()

    def _sync(self) -> None:
        self.stats.bytes_held = self.bytes_held
        self.stats.evictions = self.radix.evictions
        if self.disk is not None:
            self.stats.disk_writes, self.stats.disk_bytes = self.disk.writes, self.disk.bytes_held

    def _bypass_reason(self, n: int, bypass: bool) -> str | None:
        if self.mode == "off" or bypass:
            return "cache disabled"
        if n <= 1:
            return "prompt has at most one token"
        stored = n - 1 if self.mode == "minimal" else n  # the lab's snapshot leaves out the last token
        if stored > self.capacity_tokens:
            return f"prompt exceeds the cache capacity ({self.capacity_tokens} tokens)"
        return None

    # ---- a request ------------------------------------------------------------------------------
    def start(self, prompt_ids, sp: SamplingParams = SamplingParams(), *, salt: str | None = None,
              bypass: bool = False) -> "CachedRequest":
        """Look the prompt up and start its generation; iterate the result for tokens."""
        prompt = self.engine.check_prompt(prompt_ids, sp.max_tokens)
        n = len(prompt)
        ns = self.namespace(salt)
        report = CacheReport(mode=self.mode, prompt_tokens=n, bypass=self._bypass_reason(n, bypass))
        if report.bypass:
            self.stats.bypasses[report.bypass] += 1
            return CachedRequest(self, ns, prompt, sp, report, None, None, None)
        self.stats.lookups += 1
        match, prefix, logits = None, None, None
        if self.mode == "minimal":
            report.matched = report.reused = self.single.reusable_len(ns, prompt)
            if report.reused:
                prefix = self.single.snapshot.value
        else:
            match = self.radix.match(ns, prompt)
            if self.disk is not None and match.payload is None:
                match = self._from_disk(ns, prompt, match, report)
            report.matched = match.length
            report.exact_hit = match.payload is not None
            report.reused = n if report.exact_hit else min(match.length, n - 1)
            if report.reused:
                self.radix.acquire(match)
                prefix = KVCache.from_segment(self.radix.gather(match, report.reused))
                logits = match.payload
            report.nearest_len = match.nearest_len
        if report.matched < n:
            report.divergence_pos = report.matched
        if report.reused:
            self.stats.hits += 1
            self.stats.exact_hits += report.exact_hit
            self.stats.restores += 1
            report.snapshot_bytes = report.reused * self.bytes_per_token
        else:
            self.stats.misses += 1
        return CachedRequest(self, ns, prompt, sp, report, match, prefix, logits)

    def generate(self, prompt_ids, sp: SamplingParams = SamplingParams(), **kw):
        """Run a request to the end; returns (Generation, CacheReport)."""
        req = self.start(prompt_ids, sp, **kw)
        for _ in req:
            pass
        return req.gen, req.report

    # ---- moving snapshots in and out (files, the disk tier) ----------------------------------------
    def snapshot_of(self, tokens, salt: str | None = None) -> Snapshot | None:
        """The stored state of the longest stored prefix of `tokens` (minimal mode: the one snapshot),
        with the logits of every stored key along it; None if nothing is stored."""
        ns = self.namespace(salt)
        if self.mode == "minimal":
            s = self.single.snapshot
            if s is None or s.namespace != ns or not s.tokens:
                return None
            return Snapshot(s.tokens, np.asarray(s.value.k), np.asarray(s.value.v), salt=ns[1])
        match = self.radix.match(ns, tokens)
        if match.length == 0:
            return None
        seg = self.radix.gather(match)
        return Snapshot(self.radix.tokens(match), seg["k"], seg["v"], self.radix.payloads(match), salt=ns[1])

    def add_snapshot(self, snap: Snapshot, salt: str | None = None) -> None:
        """Store `snap` (and an exact entry for each prefix it has logits for); `salt` defaults to its own."""
        ns = self.namespace(snap.salt if salt is None else salt)
        if self.mode == "minimal":
            value = KVCache.from_segment(snap.segment(0, snap.length))
            self.single.save(ns, snap.tokens, value, snap.length * self.bytes_per_token)
        elif self.mode == "radix":
            for n in sorted(snap.logits):  # shorter keys first: each insert stores only what is new
                self.radix.insert(ns, snap.tokens[:n], snap.segment, payload=snap.logits[n])
            self.radix.insert(ns, snap.tokens, snap.segment)
        self._sync()

    def _spill(self, ns, match) -> None:
        """The radix store is evicting this key: keep it on disk if the disk budget allows."""
        if ns[0] != self.engine.fingerprint:
            return
        seg = self.radix.gather(match)
        snap = Snapshot(self.radix.tokens(match), seg["k"], seg["v"], self.radix.payloads(match), salt=ns[1])
        try:
            self.disk.put(snap)
        except OSError:  # a full or broken disk costs the entry, never the request
            pass

    def _from_disk(self, ns, prompt, match, report: CacheReport):
        """On a memory miss or partial match: if the disk tier holds a longer usable prefix, bring it
        into memory and match again."""
        n = len(prompt)
        entry, common = self.disk.find(ns[1], prompt)
        if entry is None:
            return match
        usable = n if common == n and n in entry.logits_at else min(common, n - 1)
        if usable <= min(match.length, n - 1):
            return match
        try:
            snap = self.disk.load(entry, prompt)
        except SnapshotError:
            self.stats.disk_refused += 1
            return match
        self.add_snapshot(snap, salt=ns[1])
        self.stats.disk_loads += 1
        report.disk_loaded = usable
        return self.radix.match(ns, prompt)

    def persist_to_disk(self) -> int:
        """Write every stored key to the disk tier (least recently used first, so that the newest stay
        when the disk budget is short). Returns the number of keys on disk afterwards."""
        if self.disk is None:
            return 0
        keys = []
        if self.mode == "radix":
            keys = [(ns, self.radix.tokens(m)) for ns, m in self.radix.keys() if ns[0] == self.engine.fingerprint]
        elif self.single.snapshot is not None:
            keys = [(self.single.snapshot.namespace, self.single.snapshot.tokens)]
        for ns, tokens in keys:
            snap = self.snapshot_of(tokens, salt=ns[1])
            if snap is not None:
                self.disk.put(snap)
        self._sync()
        return len(self.disk)

    def warm_from_disk(self) -> int:
        """Fill memory from the disk tier, most recently used first, while they fit the memory budget.
        Returns the number of entries loaded."""
        if self.disk is None:
            return 0
        chosen, total = [], 0
        for e in self.disk.newest_first():
            if total + e.nbytes > self.budget_bytes or (self.mode == "minimal" and chosen):
                break
            chosen.append(e)
            total += e.nbytes
        loaded = 0
        for e in reversed(chosen):  # oldest first, so the newest end up most recently used
            try:
                self.add_snapshot(self.disk.load(e))
                loaded += 1
            except SnapshotError:
                self.stats.disk_refused += 1
        self.stats.disk_loads += loaded
        self._sync()
        return loaded

    # ---- saving -----------------------------------------------------------------------------------
    def _save_prompt(self, ns, prompt, kv: KVCache, logits, report: CacheReport) -> None:
        """Called right after the prompt is in `kv` (before decode donates it)."""
        n = len(prompt)
        if self.mode == "minimal":
            self.single.save(ns, prompt[: n - 1], kv.trim(n - 1), (n - 1) * self.bytes_per_token)
            report.saved = n - 1
        else:
            payload = np.array(np.asarray(logits)[0])  # [V]: answers an identical prompt with no forward
            report.saved = self.radix.insert(ns, prompt, kv.segment, payload=payload)
        report.snapshot_bytes = max(report.snapshot_bytes, (n - 1) * self.bytes_per_token)
        self.stats.saves += 1
        self._sync()

    def _save_generated(self, ns, prompt, gen: Generation, report: CacheReport) -> None:
        """Store prompt + generated tokens, so the next chat turn reuses the answer too."""
        tokens = prompt + gen.output_ids
        if self.exact:
            # Recompute the answer's state with prefill-shaped chunks so it has the bits a cold
            # prefill of the next turn would compute (see the module docstring).
            match = self.radix.match(ns, tokens)
            if match.length < len(prompt):
                return  # the prompt was evicted meanwhile: nothing to extend
            self.radix.acquire(match)
            try:
                prefix = KVCache.from_segment(self.radix.gather(match, len(prompt)))
                kv = self.engine.restore(prefix, self.engine.slots_needed(len(prompt), len(tokens), 0))
                logits, kv = self.engine.prefill(tokens, kv)
                added = self.radix.insert(ns, tokens, kv.segment, payload=np.array(np.asarray(logits)[0]))
                self.engine.recycle(kv)
            finally:
                self.radix.release(match)
        else:
            if gen.kv is None:
                return
            tokens = tokens[: int(gen.kv.pos)]
            added = self.radix.insert(ns, tokens, gen.kv.segment)
        report.saved += added
        self.stats.saves += 1
        self._sync()


class CachedRequest:
    """A generation with the cache's work around it; iterate for `Step`s."""

    def __init__(self, cache: PrefixCache, ns, prompt, sp, report, match, prefix, logits):
        self.cache, self.ns, self.prompt, self.sp, self.report = cache, ns, prompt, sp, report
        self._match = match
        on_prefill = None
        if report.bypass is None and not report.exact_hit:
            def on_prefill(kv, lg):
                cache._save_prompt(ns, prompt, kv, lg, report)
        self.gen = cache.engine.start(prompt, sp, prefix=prefix, prefix_len=report.reused,
                                      prefix_logits=logits, on_prefill=on_prefill, exact=cache.exact)

    def _release(self) -> None:
        """Unpin the matched entries (once), so they may be evicted again."""
        if self._match is not None and self.report.reused:
            self.cache.radix.release(self._match)
        self._match = None

    def __del__(self):  # a request dropped before it ran still unpins its entries
        self._release()

    def __iter__(self):
        cache, report = self.cache, self.report
        try:
            yield from self.gen
        finally:
            self._release()
            report.prefilled = self.gen.timings.prefilled_tokens
            cache.stats.tokens_reused += report.reused
            cache.stats.tokens_prefilled += report.prefilled
        if (report.bypass is None and cache.mode == "radix" and cache.save_generated
                and self.gen.output_ids and self.gen.finish_reason):
            cache._save_generated(self.ns, self.prompt, self.gen, report)
        cache.engine.recycle(self.gen.kv)  # the request is over: its buffer can serve the next one
        self.gen.kv = None
        cache._sync()
