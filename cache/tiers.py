"""The prefix cache's tiers below memory, a part of `PrefixCache` (cache/prefix_cache.py) apart only to keep
each file short: the disk tier (`--cache-dir`, cache/store/disk.py: evicted entries spilled there, a
longer prefix found there brought back, the whole store persisted and warmed across a restart, a
prompt retained there for `prompt_cache_retention`) and the shared store (`--shared-cache`,
cache/store/shared.py: whole chunks read when memory lacks them, written through once a prompt is
computed or back when memory evicts it, and read only where reading is measured faster than
prefilling). Its methods use the cache's `store`, `disk`, `shared`, `pins`, `stats`, `engine`,
`prefill_timed` and `skipped_reads`.
"""

from __future__ import annotations

import contextlib
import time

from jaxsmol.cache.fetch import Fetch
from jaxsmol.cache.records import CacheReport, Lookup
from jaxsmol.cache.store.disk import Snapshot, SnapshotError
from jaxsmol.cache.store.shared import segment_over
from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.errors import JaxsmolError


PROBE_EVERY = 16  # of the lookups that measured reading the shared store slower, those that read it all the same


class LowerTiers:
    def _sync_shared(self) -> None:
        sh, st = self.shared, self.stats
        st.shared_hits, st.shared_misses, st.shared_writes = sh.hits, sh.misses, sh.writes
        st.shared_bytes_read, st.shared_bytes_written = sh.bytes_read, sh.bytes_written
        st.shared_unavailable = sh.unavailable

    def _evicted(self, ns, match) -> None:
        """The radix store is evicting this key: to the disk tier, and to a write-back shared store."""
        if ns[0] != self.engine.fingerprint:
            return
        if self.disk is not None:
            self._spill(ns, match)
        if self.shared is not None and self.shared.write_back:
            self._write_through(ns, self.store.tokens(match))

    def _spill(self, ns, match) -> None:
        """Keep an evicted key on disk if the disk budget allows."""
        seg = self.store.gather(match)
        snap = Snapshot(self.store.tokens(match), seg["k"], seg["v"], self.store.payloads(match), salt=ns[1])
        try:
            self.disk.put(snap)
        except OSError:  # a full or broken disk costs the entry, never the request
            pass

    def _from_disk(self, ns, prompt, match, report: CacheReport, fetched: Fetch | None = None):
        """On a memory miss or partial match: if the disk tier holds a longer usable prefix (read ahead
        in `fetched`, else read now), bring it into memory and look up again."""
        n = len(prompt)
        entry = self.disk.find(ns[1], prompt)[0] if fetched is None else fetched.disk_entry
        if entry is None:
            return match
        try:  # what was read ahead is settled (a refused file leaves the disk) even where memory has it now
            snap = self.disk.load(entry, prompt) if fetched is None else self.disk.settle(entry, fetched.snapshot)
        except SnapshotError:  # the store deleted it, saying why
            return match
        usable = _usable(n, common_prefix_len(snap.tokens, prompt), snap.logits)
        if usable <= match.reused:
            return match
        self.store.release(match)
        self.add_snapshot(snap, salt=ns[1])
        self.stats.disk_loads += 1
        report.disk_loaded = usable
        return self.store.lookup(ns, prompt, gather=False)

    def _from_shared(self, ns, prompt, match, report: CacheReport, fetched: Fetch | None = None):
        """If the shared store holds more whole chunks of the prompt than `match` reuses (up to prompt_n - 1
        positions: a chunk carries no logits, so the last token is computed), bring those past the match
        into memory (read ahead in `fetched`, else read now) and look up again."""
        size = self.shared.chunk_tokens
        usable = (len(prompt) - 1) // size
        if usable * size <= match.reused:
            return match
        first = match.length // size  # the positions before match.length are in memory already
        if fetched is not None:  # chunks from fetched.shared_first on: those past the match, if they join it
            start = fetched.shared_first
            chunks = fetched.chunks[first - start:] if start is not None and start <= first else []
        elif self._reading_pays(usable - first):
            chunks = self.shared.read_run(self.shared.keys(ns[1], prompt[: usable * size]), prompt, first)
        else:
            self.stats.shared_skipped += 1
            return match
        end = (first + len(chunks)) * size
        if end <= match.reused:
            return match
        self.store.release(match)
        for i, chunk in enumerate(chunks, first):  # a node a chunk: its arrays kept as read, not joined
            self.store.insert(ns, prompt[:(i + 1) * size], segment_over([chunk], i * size))
        self.stats.shared_loads += 1
        report.shared_loaded = end
        return self.store.lookup(ns, prompt, gather=False)

    def plan_fetch(self, prompt_ids, salt: str | None = None, bypass: bool = False) -> Fetch | None:
        """What a lookup of this prompt would read from the lower tiers, to read ahead (cache/fetch.py):
        decided now, once (a lookup given the fetch reads what it says, nothing more), and empty where it
        would read nothing (memory holding as much, reading the shared store measured slower than
        prefilling); None where a lookup reads no lower tier at all (none, a bypass, a bad prompt)."""
        if self.mode != "radix" or self.disk is None and self.shared is None or bypass:
            return None
        try:
            prompt = self.engine.check_prompt(prompt_ids, 0)
        except JaxsmolError:  # its lookup says why
            return None
        n, ns = len(prompt), self.namespace(salt)
        if self._bypass_reason(n, False):
            return None
        fetch, have = Fetch(ns, tuple(prompt)), self.store.peek(ns, prompt)
        if have == n:
            return fetch
        if self.disk is not None:
            entry, common = self.disk.find(ns[1], prompt)
            usable = 0 if entry is None else _usable(n, common, entry.logits_at)
            if usable > have:
                fetch.disk_entry, have = entry, usable
        size = self.shared.chunk_tokens if self.shared is not None else 0
        if size and (n - 1) // size > have // size:
            if self._reading_pays((n - 1) // size - have // size):
                fetch.shared_first = have // size
            else:
                self.stats.shared_skipped += 1
        return fetch

    def read_ahead(self, fetch: Fetch) -> None:
        """A fetch's reads, on the fetch thread: files and values only (never the store or the index)."""
        if fetch.disk_entry is not None:
            fetch.snapshot = self.disk.read(fetch.disk_entry, fetch.prompt)
        if fetch.shared_first is not None:
            size = self.shared.chunk_tokens
            whole = (len(fetch.prompt) - 1) // size * size
            fetch.chunks = self.shared.read_run(self.shared.keys(fetch.ns[1], fetch.prompt[:whole]), fetch.prompt,
                                                fetch.shared_first)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prompt's `tokens` positions were prefilled in `seconds` (the scheduler's measure, from the
        prompt's admission to its first token): the prefill rate `_reading_pays` weighs reads against."""
        if tokens > 0 and seconds > 0:
            self.prefill_timed[0] += tokens
            self.prefill_timed[1] += seconds

    def _reading_pays(self, chunks: int) -> bool:
        """Whether reading `chunks` chunks from the shared store is measured to take less than prefilling
        their positions: the store's read rate (bytes a second, its reads so far) against this cache's
        prefill rate (positions a second); true until both are measured, and every PROBE_EVERY-th time
        it is not, so that a store that became faster is measured again."""
        rate, (tokens, seconds) = self.shared.read_rate, self.prefill_timed
        if rate is None or not tokens:
            return True
        read_s = chunks * self.shared.chunk_bytes / rate
        if read_s <= chunks * self.shared.chunk_tokens * seconds / tokens:
            return True
        self.skipped_reads += 1
        return self.skipped_reads % PROBE_EVERY == 0

    def _write_through(self, ns, prompt, now: bool = False) -> int:
        """Hand the stored prompt's whole chunks to the shared store, which writes those it lacks: on its
        writer thread, from the store's segments (immutable, so nothing is copied here), or `now` on
        this one (the chunks written)."""
        whole = len(prompt) // self.shared.chunk_tokens * self.shared.chunk_tokens
        match = self.store.match(ns, prompt[:whole], touch=False)
        if not whole or match.length < whole:
            return 0
        args = (self.shared.keys(ns[1], prompt), prompt, segment_over(self.store.parts(match, whole)))
        if now:
            return self.shared.write_missing(*args)
        self.shared.write_through(*args)
        return 0

    def persist_to_shared(self) -> int:
        """A write-back shared store's shutdown: every stored key's whole chunks it lacks, written now (on
        this thread); the chunks written."""
        if self.shared is None or not self.shared.write_back:
            return 0
        written = sum(self._write_through(ns, tokens, now=True) for ns, tokens in self.store.entries()
                      if ns[0] == self.engine.fingerprint)
        self._sync_shared()
        return written

    def persist_to_disk(self) -> int:
        """Write every stored key to the disk tier (least recently used first, so that the newest stay
        when the disk budget is short). Returns the number of keys on disk afterwards."""
        if self.disk is None:
            return 0
        keys = [(ns, tokens) for ns, tokens in self.store.entries() if ns[0] == self.engine.fingerprint]
        for ns, tokens in self.pins.keys(lasting=True):  # an expiring pin is written as an ordinary entry
            self.pins.write(ns, tokens)
        for ns, tokens in keys:
            snap = self.snapshot_of(tokens, salt=ns[1])
            if snap is not None:
                snap.pinned = self.pins.is_pinned(ns, tokens, lasting=True)
                self.disk.put(snap)
        self.disk.drain()  # a background store's queued writes: in the files before this returns
        self.sync()
        return len(self.disk)

    def retain(self, lk: Lookup, seconds: float) -> bool:
        """Keep lk's stored prompt in the disk tier for `seconds` (out of its LRU's reach until then; a
        file pinned, or retained for more than half of that already, is left as it is); False without a disk tier,
        or where it does not fit (the rest of the disk budget is retained) or the disk fails."""
        if self.disk is None or lk.report.bypass is not None or self.mode != "radix":
            return False
        held = self.disk.entries.get(self.disk.name_of(lk.ns[1], lk.prompt))
        if held is not None and (held.pinned or held.expires_at is not None and
                                 held.expires_at - time.time() > seconds / 2):
            return True
        snap = self.snapshot_of(lk.prompt, salt=lk.ns[1])
        if snap is None or snap.length != len(lk.prompt):
            return False
        snap.expires_at = time.time() + seconds
        try:
            return self.disk.put(snap)
        except OSError:  # a full or broken disk costs the retention, never the request
            return False

    def warm_from_disk(self) -> int:
        """Pin the disk tier's pinned entries again (while the pinned budget allows: a warning in
        `pins.warnings` for each one that did not fit), then fill memory with the others, most recently
        used first, while they fit the memory budget. Returns the number of entries loaded."""
        if self.disk is None:
            return 0
        pinned = [e for e in self.disk.entries.values() if e.pinned]
        if self.mode == "radix" and pinned:
            self.pins.restored, self.pins.warnings = self.pins.restore(pinned)
        chosen, total = [], 0
        for e in self.disk.newest_first():
            if e.pinned and self.mode == "radix":
                continue
            if total + e.nbytes > self.budget_bytes or len(chosen) == self.store.max_keys:
                break
            chosen.append(e)
            total += e.nbytes
        loaded = 0
        for e in reversed(chosen):  # oldest first, so the newest end up most recently used
            with contextlib.suppress(SnapshotError):  # a refused file: the store deleted it, saying why
                self.add_snapshot(self.disk.load(e))
                loaded += 1
        self.stats.disk_loads += loaded
        self.sync()
        return loaded + self.pins.restored


def _usable(n: int, common: int, logits_at) -> int:
    """Positions of an n-token prompt a stored prefix sharing `common` of them restores: all n where it has
    the logits after them (an exact full hit), else at most n - 1 (the last token is computed)."""
    return n if common == n and n in logits_at else min(common, n - 1)
