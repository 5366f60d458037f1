"""The prefix cache in front of the engine: bypass, lookup, restore, continue, save.

Modes, each one radix store (cache/store/radix.py) used its own way:
  "radix"    many prefixes, longest match at token granularity, the last prompt position's logits kept
             for an exact full hit (no forward at all), generated tokens saved too (the next chat turn
             repeats them), LRU under a byte budget
  "single"   one snapshot of the first prompt_n - 1 tokens (the store holds one key; a save replaces it)
  "off"      every request bypasses (the store stays empty)

Keys are namespaced by the model fingerprint (config, dtype, weights) and an optional salt.

A second tier on disk (`disk=DiskStore(...)`, cache/store/disk.py), radix mode: evicted entries are written
there while its budget allows, a lookup that finds a longer prefix there than in memory brings it back
first, and `persist_to_disk` / `warm_from_disk` carry the whole store across a restart.
A third tier several daemons share (`shared=SharedStore(...)`, cache/store/shared.py), radix mode: a lookup
that finds more whole chunks of the prompt there than memory and disk matched brings them into memory
first (`_from_shared`); a saved prompt's whole chunks the store lacks are written to it (`_write_through`).
Both lower tiers' methods are in cache/tiers.py (`LowerTiers`, this class's base).
`snapshot_of` / `add_snapshot` move one stored key out of and into the cache, in either mode.
Pinned prefixes (`cache.pins`, cache/pins.py) are radix keys kept out of eviction under a budget of
their own, for good or until an expiry (a request's cache breakpoints); `cached_prefix` tells how much
of a prompt is stored without touching anything (what cache-aware admission orders waiting requests by).

Exactness: a warm run gives the bits of a cold run. Prefill chunks come from the engine's exact
buckets wherever they start (see jaxsmol/runtime/engine.py: >= 64 rows on XLA's matmul; 16 and 32 too with
the CPU kernels), and the generated tokens' state is saved only after re-prefilling it the same way
(cache/answers.py), because single-token decode rows differ from prefill rows in the last bits. With
exact=False (the non-bitwise fast path) a short suffix after a restore may take fewer rows than the
exact buckets allow (one row for one token; 16 or 32 on XLA's matmul): cheaper, but a warm run may
then differ from a cold one in the last bits (and rarely in a sampled token).

Requests run through the scheduler (cache/scheduler/), the library's one at a time too
(`jaxsmol.cache.generate`): it calls lookup, save_prompt, finish, release and the answer's saves here.
"""

from __future__ import annotations


import numpy as np

from jaxsmol.cache.device_rows import DeviceRows
from jaxsmol.cache.fetch import Fetch, Fetcher
from jaxsmol.cache.named import NamedContents
from jaxsmol.cache.pins import DEFAULT_BUDGET_BYTES, Pins
from jaxsmol.cache.records import AnswerSave, CacheReport, CacheStats, Lookup
from jaxsmol.cache.store.disk import DiskStore, Snapshot
from jaxsmol.cache.store.radix import RadixStore
from jaxsmol.cache.store.shared import SharedStore
from jaxsmol.cache.tiers import LowerTiers
from jaxsmol.runtime.engine import Engine
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import SEQ_AXIS

MODES = ("radix", "single", "off")


class PrefixCache(LowerTiers):
    def __init__(self, engine: Engine, mode: str = "radix", budget_bytes: int = 2 << 30, salt: str = "",
                 save_generated: bool = True, exact: bool = True, disk: DiskStore | None = None,
                 pinned_bytes: int = DEFAULT_BUDGET_BYTES, shared: SharedStore | None = None):
        if mode not in MODES:
            raise JaxsmolError(f"cache mode must be one of {', '.join(MODES)}, got {mode!r}")
        if budget_bytes < 0:
            raise JaxsmolError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.engine, self.mode, self.salt = engine, mode, salt
        self.save_generated, self.exact = save_generated, exact
        self.bytes_per_token = engine.kv_bytes_per_token
        self.budget_bytes = budget_bytes
        self.store = RadixStore(budget_bytes, seq_axis=SEQ_AXIS, max_keys=1 if mode == "single" else None)
        self.keeps_last_position = mode == "radix"  # a whole prompt, its last logits as the payload
        self.stats = CacheStats()
        self.device = DeviceRows(self)
        self.pins = Pins(self, pinned_bytes)
        self.named = NamedContents(self.pins)
        self.disk = disk if mode != "off" else None
        if self.disk is not None:
            self.stats.disk_refused = self.disk.refused  # counted where the files are read
        if shared is not None and not exact:  # its states would reach exact caches through the store
            raise JaxsmolError("a shared store takes exact states only: PrefixCache(exact=False) cannot use one")
        self.shared = shared if mode == "radix" else None
        self.prefill_timed, self.skipped_reads = [0, 0.0], 0  # positions prefilled and their seconds (note_prefill)
        self.fetcher = Fetcher()  # the lower tiers read ahead for waiting requests (cache/fetch.py)
        if mode == "radix" and (self.disk is not None or self.shared is not None and self.shared.write_back):
            self.store.on_evict = self._evicted
        if self.shared is not None:  # counted where the values are read and written
            self.stats.shared_refused, self.stats.shared_dropped = self.shared.refused, self.shared.dropped
            self.shared.on_written = self._sync_shared  # its writer thread's counts reach the stats at once
        if mode != "off":  # hash the weights now, not inside the first request's time to first token
            _ = engine.fingerprint

    # ---- bookkeeping ----------------------------------------------------------------------------
    def namespace(self, salt: str | None = None) -> tuple:
        return (self.engine.fingerprint, self.salt if salt is None else salt)

    @property
    def capacity_tokens(self) -> int:
        """Positions whose state fits the byte budget (radix mode also keeps a prompt's last logits)."""
        logits_bytes = 4 * self.engine.cfg.vocab_size if self.keeps_last_position else 0
        return max(self.budget_bytes - logits_bytes, 0) // self.bytes_per_token

    @property
    def bytes_held(self) -> int:
        return self.store.bytes_held

    def flush(self) -> None:
        """Forget every entry but the pinned ones, the disk tier's too (unpin a prefix to forget it); a
        write-back shared store first gets what it lacks (it is every daemon's: it is not flushed)."""
        self.persist_to_shared()
        self.store.clear(keep_pinned=True)
        if self.disk is not None:
            self.disk.clear(keep_pinned=True)
        self.sync()

    def cached_prefix(self, prompt_ids, salt: str | None = None, bypass: bool = False) -> int:
        """How many leading tokens of the prompt are stored in memory: a walk of the store, nothing
        gathered, held or touched (the disk tier is not consulted)."""
        if self.mode == "off" or bypass:
            return 0
        return self.store.peek(self.namespace(salt), prompt_ids)

    def sync(self) -> None:
        self.stats.bytes_held = self.bytes_held
        self.stats.pinned_bytes = self.store.pinned_bytes
        self.stats.evictions = self.store.evictions
        if self.disk is not None:
            self.stats.disk_writes, self.stats.disk_bytes = self.disk.writes, self.disk.bytes_held
        if self.shared is not None:
            self._sync_shared()

    def _bypass_reason(self, n: int, bypass: bool) -> str | None:
        if self.mode == "off" or bypass:
            return "cache disabled"
        if n <= 1:
            return "prompt has at most one token"
        stored = n if self.keeps_last_position else n - 1  # a single snapshot leaves out the last token
        if stored > self.capacity_tokens:
            return f"prompt exceeds the cache capacity ({self.capacity_tokens} tokens)"
        return None

    def continuation(self, lk: Lookup, most: int) -> list[int]:
        """Up to `most` tokens stored after lk's prompt in its namespace (an earlier answer to it, or a
        longer prompt it begins): speculation's drafts from the cache."""
        return [] if lk.ns is None or self.mode == "off" else self.store.continuation(lk.ns, lk.prompt, most)

    # ---- a request ------------------------------------------------------------------------------
    def lookup(self, prompt_ids, max_tokens: int = 0, *, salt: str | None = None, bypass: bool = False,
               fetched: Fetch | None = None) -> Lookup:
        """Check the prompt and find its longest stored prefix; the entries found stay pinned (never
        evicted) until `release(lookup)`. `fetched`: its lower tiers' reads, made ahead (plan_fetch; done),
        taken instead of reading them now. Raises JaxsmolError for a bad prompt."""
        prompt = self.engine.check_prompt(prompt_ids, max_tokens)
        n = len(prompt)
        reason = self._bypass_reason(n, bypass)  # a bypass needs no namespace (nor the weights' hash)
        lk = Lookup(None if reason else self.namespace(salt), prompt,
                    CacheReport(mode=self.mode, prompt_tokens=n, bypass=reason))
        report = lk.report
        if report.bypass:
            self.stats.bypasses[report.bypass] += 1
            return lk
        self.stats.lookups += 1
        match = self.store.lookup(lk.ns, prompt, gather=False)
        if fetched is not None and (fetched.ns, fetched.prompt) != (lk.ns, tuple(prompt)):
            raise ValueError("a fetch made for another prompt")
        if self.disk is not None and match.payload is None:
            match = self._from_disk(lk.ns, prompt, match, report, fetched)
        if self.shared is not None and match.payload is None:
            match = self._from_shared(lk.ns, prompt, match, report, fetched)
        report.matched, report.reused, report.nearest_len = match.length, match.reused, match.nearest_len
        report.exact_hit = match.payload is not None
        if report.reused:
            lk.match, lk.logits = match, match.payload
            lk.parts = self.store.parts(match, match.reused)
        if report.matched < n:
            report.divergence_pos = report.matched
        if report.reused:
            self.stats.hits += 1
            self.stats.exact_hits += report.exact_hit
            self.stats.restores += 1
            report.snapshot_bytes = report.reused * self.bytes_per_token
        else:
            self.stats.misses += 1
        return lk

    def release(self, lk: Lookup) -> None:
        """Unpin what `lookup` pinned (once; later calls do nothing): call it once the prefix is restored,
        so that the store's budget bounds what it holds, leased entries included."""
        if lk.match is not None:
            self.store.release(lk.match)
            lk.match, lk.parts = None, None

    def finish(self, lk: Lookup, prefilled: int) -> None:
        """Account a request whose prompt is done: `prefilled` positions were computed."""
        lk.report.prefilled = prefilled
        self.stats.tokens_reused += lk.report.reused
        self.stats.tokens_prefilled += prefilled
        self.sync()

    # ---- moving snapshots in and out (files, the disk tier) ----------------------------------------
    def snapshot_of(self, tokens, salt: str | None = None) -> Snapshot | None:
        """The stored state of the longest stored prefix of `tokens`, with the logits of every stored key
        along it; None if nothing is stored."""
        ns = self.namespace(salt)
        state = self.store.state(ns, tokens)
        if state is None:
            return None
        stored, value, payloads = state
        return Snapshot(stored, np.asarray(value["k"]), np.asarray(value["v"]), payloads, salt=ns[1])

    def add_snapshot(self, snap: Snapshot, salt: str | None = None) -> None:
        """Store `snap` (and an exact entry for each prefix it has logits for); `salt` defaults to its own."""
        if self.mode != "off":
            self.store.add(self.namespace(snap.salt if salt is None else salt), snap.tokens, snap.segment,
                           snap.logits)
        self.sync()

    # ---- saving -----------------------------------------------------------------------------------
    def save_prompt(self, lk: Lookup, kv, logits) -> None:
        """Store the prompt's state; call right after the prompt is in `kv` (anything with `segment(start,
        stop)`: a row of the KV arena, a KVCache) and before decoding overwrites it."""
        if lk.report.bypass is not None or lk.report.exact_hit:
            return
        ns, prompt, report = lk.ns, lk.prompt, lk.report
        n = len(prompt)
        if self.keeps_last_position:
            payload = np.array(np.asarray(logits)[0])  # [V]: answers an identical prompt with no forward
            report.saved = self.store.insert(ns, prompt, kv.segment, payload=payload)
            if self.shared is not None and not self.shared.write_back:
                self._write_through(ns, prompt)
        else:  # the single snapshot: the first prompt_n - 1 positions
            report.saved = self.store.insert(ns, prompt[: n - 1], kv.segment)
        self.device.tag(kv, ns, prompt)
        report.snapshot_bytes = max(report.snapshot_bytes, (n - 1) * self.bytes_per_token)
        self.stats.saves += 1
        self.sync()

    def wants_answer(self, lk: Lookup, output_ids) -> bool:
        """Whether prompt + answer should be stored (a store of many keys, consulted, and an answer)."""
        return (lk.report.bypass is None and self.mode == "radix" and self.save_generated
                and bool(output_ids))

    def begin_answer(self, lk: Lookup, output_ids) -> AnswerSave | None:
        """An answer to store for the next turn (`finish_answer`): prompt + answer, whose answer's state
        is recomputed with prefill-shaped chunks from the prompt's, so that it has the bits a cold
        prefill of the next turn would compute (see the module docstring). Nothing is held while it
        waits (a waiting answer holding its prompt's entries kept them past the budget: 64 of them at
        most). None if the prompt was evicted meanwhile (nothing to extend), the answer is stored, or
        prompt + answer is more than the cache can hold."""
        tokens = list(lk.prompt) + list(output_ids)
        if len(tokens) > self.capacity_tokens:
            return None
        stored = self.store.peek(lk.ns, tokens)
        if stored < len(lk.prompt) or stored == len(tokens):
            return None
        return AnswerSave(lk, tokens)

    def answer_row(self, save: AnswerSave, lease) -> int | None:
        """A row taken by `lease` holding the stored prompt of an answer to store (its entries held only
        meanwhile); None if they were evicted since."""
        n = len(save.lookup.prompt)
        match = self.store.match(save.lookup.ns, save.tokens[:n])
        if match.length < n:
            return None
        self.store.acquire(match)
        try:
            return self.device.row_for(lease, match, n, len(save.tokens), self.store.parts(match, n))
        finally:
            self.store.release(match)

    def finish_answer(self, save: AnswerSave, kv, logits) -> None:
        """Store prompt + answer from `kv` holding all of it (None: give up)."""
        if kv is not None:
            added = self.store.insert(save.lookup.ns, save.tokens, kv.segment,
                                      payload=np.array(np.asarray(logits)[0]))
            self.device.tag(kv, save.lookup.ns, save.tokens)
            save.lookup.report.saved += added
            self.stats.saves += 1
        self.sync()
