"""Prefix snapshots on disk: the single file of `--prompt-cache FILE`, and a directory of files (the
daemon's second tier). The file format, its checks and atomic writes are in cache/store/snapshot.py.

`load_prompt_cache` / `save_prompt_cache` are the single-file `--prompt-cache FILE` of the command line;
a file refused as not a snapshot at all (a typo naming the user's own file) is never overwritten.
`DiskStore` is a directory of snapshot files, one per stored key, least recently used first out under a
byte budget (`--cache-dir`); a pinned snapshot (the manifest's `pinned` mark) is never evicted and not
counted against that budget (the in-memory pinned budget bounds it). `list_dir`, `remove_entry` and
`mark_entry` serve `jaxsmol cache ls|rm|pin|unpin DIR` without a model. Neither knows how the in-memory
cache is built: they call
`cache.add_snapshot(snap)` and `cache.snapshot_of(tokens)` (cache/prefix_cache.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from pathlib import Path

from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.cache.store.snapshot import (Snapshot, SnapshotError, identity, is_snapshot_file, load_snapshot,
                                          read_manifest, save_snapshot, set_pinned)
from jaxsmol.errors import JaxsmolError

# The snapshot names are re-exported: callers of the prompt cache and the second tier import from here.
__all__ = ["DiskStore", "PromptCacheReport", "Snapshot", "SnapshotError", "identity", "load_prompt_cache",
           "load_snapshot", "save_prompt_cache", "save_snapshot"]

SUFFIX = ".safetensors"
_ENTRY_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))  # DiskStore's files; it touches no other
LOGGER = logging.getLogger("jaxsmol.cache")
# snapshots a background store holds for its writer thread; past this a put writes on the caller's thread (a
# disk slower than the evictions slows them down rather than holding their snapshots without bound)
QUEUE_BYTES = 256 << 20


# ---- --prompt-cache FILE: one snapshot a file ---------------------------------------------------------
@dataclasses.dataclass
class PromptCacheReport:
    file: str
    loaded: int = 0  # tokens of the snapshot put in the cache
    refused: str | None = None  # why the file was not used
    foreign: bool = False  # the file is not a snapshot: it is never overwritten
    saved: int = 0  # tokens written back

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_prompt_cache(cache, path, prompt) -> PromptCacheReport:
    """Put the snapshot in `path` (if there is one) into `cache`; a refused file is reported, not raised."""
    report = PromptCacheReport(file=str(path))
    if not os.path.lexists(path):
        return report
    try:
        snap = load_snapshot(path, identity(cache.engine), prompt)
    except SnapshotError as e:
        report.refused = str(e)
        if not is_snapshot_file(path):
            report.foreign = True
            report.refused += "; it is not a jaxsmol snapshot, so it is left as it is (not overwritten)"
        return report
    cache.add_snapshot(snap, salt="")
    report.loaded = snap.length
    return report


def save_prompt_cache(cache, path, tokens, report: PromptCacheReport | None = None) -> int:
    """Write the cache's state of the longest stored prefix of `tokens` to `path` (one snapshot).
    Nothing is written over a file that is not a snapshot: 0 if `report` says it was refused as one,
    SnapshotError if such a file is there now."""
    if report is not None and report.foreign:
        return 0
    if os.path.lexists(path) and not is_snapshot_file(path):
        raise SnapshotError(f"refusing to overwrite {path}: it is not a jaxsmol prefix snapshot")
    snap = cache.snapshot_of(tokens, salt="")
    if snap is None:
        return 0
    save_snapshot(path, snap, identity(cache.engine))
    if report is not None:
        report.saved = snap.length
    return snap.length


# ---- a directory of snapshots: the daemon's second tier --------------------------------------------
@dataclasses.dataclass
class DiskEntry:
    path: Path
    salt: str
    tokens: tuple
    logits_at: tuple
    nbytes: int
    last_used: float
    pinned: bool = False
    expires_at: float | None = None  # a pin's expiry, or an unpinned file's retention (seconds since the epoch)
    record: dict | None = None  # a named cached content's record (cache/named.py)
    pending: bool = False  # queued for the writer thread: not yet a file to read
    failed: bool = False  # its write failed (the writer thread said why): out of the index at the next put

    @classmethod
    def of(cls, path: Path, m: dict, st: os.stat_result) -> DiskEntry:
        """The entry of the file at `path` (its manifest `m`, its stat `st`); KeyError, TypeError or
        ValueError for a malformed manifest."""
        expires_at, record = m.get("expires_at"), m.get("record")
        if not (expires_at is None or isinstance(expires_at, (int, float))) or not (
                record is None or isinstance(record, dict) and isinstance(record.get("name"), str)):
            raise ValueError("malformed expires_at or record")
        return cls(path, str(m.get("salt", "")), tuple(int(t) for t in m["tokens"]),
                   tuple(int(n) for n in m["logits_at"]), st.st_size, st.st_mtime, m.get("pinned") is True,
                   expires_at, record)

    def marks(self) -> tuple:
        return self.pinned, self.expires_at, self.record

    def retained(self, now: float) -> bool:
        """An unpinned file kept out of the LRU's reach until its `expires_at`."""
        return not self.pinned and self.expires_at is not None and self.expires_at > now

    @property
    def key(self) -> str:
        """The entry's name without its suffix: what `jaxsmol cache rm|pin DIR KEY` and GET /v1/cache call it."""
        return self.path.name[: -len(SUFFIX)]


class DiskStore:
    """Snapshot files in one directory, one per stored key, LRU under `budget_bytes`.

    The index (salt, tokens, size of every usable file) is read from the headers when opened. Only
    files named like its own (`<32 hex digits>.safetensors`) are considered; of those, files of another
    model, tokenizer or format version are left alone and not counted (another daemon may share the
    directory), and `skipped` lists them with reasons. A file refused when read (its checksum, its
    data), or found damaged when indexed, is deleted: a warning names it and why, and `refused`
    counts it by reason (SnapshotError.reason).
    """

    def __init__(self, directory, ident: dict, budget_bytes: int = 4 << 30, background: bool = False):
        """background: files are written on a writer thread (the daemon's: a spill or a retention then
        costs the request path the snapshot's copy, not its file), QUEUE_BYTES of snapshots at most; an
        entry is indexed at once and read once written (`drain` waits for the writes queued)."""
        if budget_bytes < 0:
            raise JaxsmolError(f"disk cache budget must be >= 0 bytes, got {budget_bytes}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JaxsmolError(f"cannot use cache directory {self.dir}: {e}") from None
        self.ident, self.budget_bytes = ident, int(budget_bytes)
        self.entries: dict[str, DiskEntry] = {}
        self.skipped: list[tuple[str, str]] = []
        self.refused: Counter = Counter()  # SnapshotError.reason -> files deleted
        self.writes = 0
        self._queue: queue.Queue | None = None
        if background:
            self._queue = queue.Queue()
            threading.Thread(target=self._writer, name="jaxsmol-disk-writes", daemon=True).start()
        now = time.time()
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(".") and p.name.endswith(".tmp") and _ENTRY_NAME.match(p.name[1:]):
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > 60:  # a write that never finished (a crash): never loadable
                        p.unlink()
            elif _ENTRY_NAME.fullmatch(p.name) and p.is_file():
                self._index(p)

    def _index(self, p: Path) -> None:
        try:
            st = p.stat()
        except OSError:  # gone meanwhile (another process shares the directory)
            return
        if st.st_size > self.ident.get("max_bytes", st.st_size):  # e.g. written with a longer context: kept
            self.skipped.append((p.name, f"{st.st_size} bytes, over this engine's cap of {self.ident['max_bytes']}"))
            return
        try:
            entry = DiskEntry.of(p, read_manifest(p, self.ident), st)
        except SnapshotError as e:
            if e.reason == "corrupted":
                self._refuse(p, e)
            else:
                self.skipped.append((p.name, str(e)))
            return
        except (KeyError, TypeError, ValueError) as e:  # a well-formed header with a malformed manifest
            self.skipped.append((p.name, f"malformed manifest ({type(e).__name__}: {e})"))
            return
        self.entries[p.name] = entry

    def name_of(self, salt: str, tokens) -> str:
        return entry_key(self.ident, salt, tokens) + SUFFIX

    @property
    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @property
    def unpinned_bytes(self) -> int:
        """The bytes under `budget_bytes` (pinned files are bounded by the pinned budget instead)."""
        return sum(e.nbytes for e in self.entries.values() if not e.pinned)

    def __len__(self) -> int:
        return len(self.entries)

    def _touch(self, e: DiskEntry) -> None:
        e.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(e.path, (e.last_used, e.last_used))  # the LRU order survives a restart

    def _drop(self, name: str) -> None:
        e = self.entries.pop(name)
        with contextlib.suppress(OSError):
            e.path.unlink()

    def _refuse(self, path: Path, error: SnapshotError) -> None:
        """Delete a file that failed its checks (out of the index too), saying so."""
        if path.name in self.entries:
            self._drop(path.name)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        self.refused[error.reason] += 1
        LOGGER.warning("disk tier: removed %s (%s): %s", path, error.reason, error)

    def put(self, snap: Snapshot) -> bool:
        """Store `snap` (evicting the least recently used unpinned files not retained to make room; a
        pinned one always goes in); False if it cannot fit. A file there already is kept, rewritten
        only when the snapshot's marks (pinned, expires_at, record) differ from it; a pinned or retained
        file is not made a plain one by a plain write (a spill, a persist)."""
        for n in [n for n, e in self.entries.items() if e.failed]:
            self.entries.pop(n)
        name, now = self.name_of(snap.salt, snap.tokens), time.time()
        old = self.entries.get(name)
        marks = (snap.pinned, snap.expires_at and round(snap.expires_at, 3), snap.record)
        plain_over_kept = marks == (False, None, None) and old is not None and (old.pinned or old.retained(now))
        if old is not None and (old.marks() == marks or plain_over_kept):
            self._touch(old)
            return True
        self.entries.pop(name, None)  # rewritten below, with its new marks
        if not snap.pinned:
            if snap.nbytes > self.budget_bytes:
                return False
            unpinned = sorted((e.last_used, n) for n, e in self.entries.items() if not e.pinned)
            held = sum(self.entries[n].nbytes for _, n in unpinned)
            unpinned = [(t, n) for t, n in unpinned if not self.entries[n].retained(now)]
            for _, n in unpinned:
                if held + snap.nbytes <= self.budget_bytes:
                    break
                held -= self.entries[n].nbytes
                self._drop(n)
            if held + snap.nbytes > self.budget_bytes:  # the rest is retained until its expiry
                return False
        later = self._queue is not None and self.queued_bytes + snap.nbytes <= QUEUE_BYTES
        entry = DiskEntry(self.dir / name, snap.salt, snap.tokens, tuple(sorted(snap.logits)), snap.nbytes,
                          time.time(), *marks, pending=later)
        if later:
            self.entries[name] = entry
            self._queue.put((entry, snap))
            return True
        entry.nbytes = save_snapshot(entry.path, snap, self.ident)
        self.entries[name] = entry
        self.writes += 1
        return True

    def _writer(self) -> None:
        """The writer thread: each queued entry's file; one dropped from the index meanwhile is removed."""
        while True:
            entry, snap = self._queue.get()
            try:
                entry.nbytes = save_snapshot(entry.path, snap, self.ident)
                entry.pending = False
                self.writes += 1
                if self.entries.get(entry.path.name) is not entry:
                    with contextlib.suppress(OSError):
                        entry.path.unlink()
            except Exception as e:  # a full or broken disk costs the entry, never the thread
                entry.failed = True
                LOGGER.warning("disk tier: could not write %s: %s", entry.path, e)
            finally:
                self._queue.task_done()

    @property
    def queued_bytes(self) -> int:
        """Bytes of the snapshots waiting for the writer thread (held in memory until written)."""
        return sum(e.nbytes for e in list(self.entries.values()) if e.pending)

    def drain(self) -> None:
        """Until the writes queued are done."""
        if self._queue is not None:
            self._queue.join()

    def forget(self, salt: str, tokens) -> bool:
        """Delete the file of exactly this key (an unpinned prefix leaves disk until it is written again)."""
        name = self.name_of(salt, tokens)
        if name not in self.entries:
            return False
        self._drop(name)
        return True

    def find(self, salt: str, prompt) -> tuple[DiskEntry | None, int]:
        """The entry sharing the longest prefix with `prompt` (ties: one with logits there), and that length."""
        best, best_key = None, (0, False)
        for e in list(self.entries.values()):
            if e.salt != salt or e.pending or e.failed:
                continue
            n = common_prefix_len(e.tokens, prompt)
            key = (n, n in e.logits_at)
            if n and key > best_key:
                best, best_key = e, key
        return best, best_key[0]

    def load(self, entry: DiskEntry, prompt=None) -> Snapshot:
        """Read and verify an entry; a refused one leaves the index and the disk (_refuse)."""
        return self.settle(entry, self.read(entry, prompt))

    def read(self, entry: DiskEntry, prompt=None) -> Snapshot | SnapshotError:
        """An entry's snapshot, read and verified, or the error refusing it; nothing else is done, so any
        thread may read (cache/fetch.py) while the index's own thread `settle`s what it got."""
        try:
            return load_snapshot(entry.path, self.ident, prompt)
        except SnapshotError as e:
            return e

    def settle(self, entry: DiskEntry, got: Snapshot | SnapshotError) -> Snapshot:
        """What `read` gave: the entry touched, or, refused, out of the index and the disk (where it is
        still the entry indexed: one written over it meanwhile stays) and the error raised."""
        current = self.entries.get(entry.path.name) is entry
        if isinstance(got, SnapshotError):
            if current:
                self._refuse(entry.path, got)
            raise got
        if current:
            self._touch(entry)
        return got

    def newest_first(self) -> list[DiskEntry]:
        """The entries written, the most recently used first."""
        return sorted((e for e in self.entries.values() if not (e.pending or e.failed)),
                      key=lambda e: e.last_used, reverse=True)

    def clear(self, keep_pinned: bool = False) -> None:
        for name in [n for n, e in self.entries.items() if not (keep_pinned and e.pinned)]:
            self._drop(name)


def entry_key(ident: dict, salt: str, tokens) -> str:
    """The 32-hex-digit key of a stored prefix: its disk file's name and its key in GET /v1/cache."""
    key = json.dumps([ident["model"], ident["tokenizer"], salt, [int(t) for t in tokens]])
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


# ---- a directory, without a model: `jaxsmol cache ls|rm|pin|unpin DIR` --------------------------------
def list_dir(directory) -> tuple[list[DiskEntry], list[tuple[str, str]]]:
    """Every snapshot file of a cache directory, of any model (its manifest read, nothing verified),
    the largest first; and (name, reason) of the files named like entries that could not be read."""
    entries, bad = [], []
    d = Path(directory)
    if not d.is_dir():
        raise JaxsmolError(f"{d} is not a directory")
    for p in sorted(d.iterdir()):
        if not (_ENTRY_NAME.fullmatch(p.name) and p.is_file()):
            continue
        try:
            entries.append(DiskEntry.of(p, read_manifest(p), p.stat()))
        except (SnapshotError, OSError, KeyError, TypeError, ValueError) as e:
            bad.append((p.name, str(e)))
    return sorted(entries, key=lambda e: (-e.nbytes, e.path.name)), bad


def entry_path(directory, key: str) -> Path:
    """The file of entry KEY (32 hex digits, with or without .safetensors) in a cache directory;
    JaxsmolError naming what is wrong."""
    name = key if key.endswith(SUFFIX) else key + SUFFIX
    if not _ENTRY_NAME.fullmatch(name):
        raise JaxsmolError(f"{key!r} is not an entry key (32 hex digits, as `jaxsmol cache ls` prints them)")
    path = Path(directory) / name
    if not path.is_file():
        raise JaxsmolError(f"no entry {name[: -len(SUFFIX)]} in {directory}")
    return path


def remove_entry(directory, key: str) -> Path:
    path = entry_path(directory, key)
    path.unlink()
    return path


def mark_entry(directory, key: str, pinned: bool) -> Path:
    path = entry_path(directory, key)
    set_pinned(path, pinned)
    return path
