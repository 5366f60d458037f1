"""Prefix snapshots on disk: one safetensors file a snapshot, and a directory of them (the second tier).

A file holds a snapshot's keys and values trimmed to its length (`k`, `v`: [L, B, n, K, H]), the
logits after some of its prefixes (`logits`: [P, V], the lengths in the manifest's `logits_at`),
and a JSON manifest in the safetensors metadata:

    format, version      "jaxsmol.prefix-snapshot", FORMAT_VERSION
    model                Engine.fingerprint (config, dtype, every weight byte)
    tokenizer            Tokenizer.fingerprint (tokenizer.json bytes + chat template), "none" without one
    salt                 the cache namespace's salt ("" unless a tenant set one)
    tokens, length       the token ids the state was computed from, and how many
    logits_at, dtypes    prefix lengths that have logits; each tensor's dtype (bfloat16 is stored as uint16)
    checksum             blake2b over this manifest (checksum left out) and every tensor's name, dtype,
                         shape and bytes

`load_snapshot` refuses (SnapshotError, one line naming why) a file that does not parse, is
truncated, has another format version, fails its checksum, comes from another model or tokenizer,
or shares no prefix with the prompt. A caller then takes the cold path, which is always correct.

Writes are atomic: a temporary file in the same directory, fsync, `os.replace`, fsync of the
directory. A crash at any point leaves either the old file or the new one, never half of one
(temporary files are named `.NAME.*.tmp` and never loaded).

`DiskStore` is a directory of such files, one per stored key, least recently used first out under a
byte budget: the daemon's second tier (`--cache-dir`). `load_prompt_cache` / `save_prompt_cache` are
the single-file `--prompt-cache FILE` of the command line. Neither knows how the in-memory cache is
built: they call `cache.add_snapshot(snap)` and `cache.snapshot_of(tokens)` (cache/prefix_cache.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path

import numpy as np

from cache.minimal import common_prefix_len
from jaxsmol.errors import JaxsmolError

FORMAT = "jaxsmol.prefix-snapshot"
FORMAT_VERSION = 1
MANIFEST_KEY = "jaxsmol"
SUFFIX = ".safetensors"
_ENTRY_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))  # DiskStore's files; it touches no other
_STORABLE = {"float64", "float32", "float16", "int64", "uint64", "int32", "uint32", "int16", "uint16",
             "int8", "uint8", "bool"}


class SnapshotError(JaxsmolError):
    """A snapshot file that must not be used; the message says why."""


def identity(engine) -> dict:
    """What a snapshot must have been made with to be used by `engine`."""
    tok = engine.tokenizer
    tok_fp = "none" if tok is None else (getattr(tok, "fingerprint", None) or f"unhashed:{type(tok).__name__}")
    return {"model": engine.fingerprint, "tokenizer": tok_fp}


@dataclasses.dataclass
class Snapshot:
    """The state of `tokens`: keys and values [L, B, n, K, H] and the logits after some prefixes."""
    tokens: tuple
    k: np.ndarray
    v: np.ndarray
    logits: dict = dataclasses.field(default_factory=dict)  # prefix length -> logits [V] after its last token
    salt: str = ""

    def __post_init__(self):
        self.tokens = tuple(int(t) for t in self.tokens)
        if not (self.k.shape == self.v.shape and self.k.ndim == 5 and self.k.shape[2] == len(self.tokens)):
            raise ValueError(f"k {self.k.shape} and v {self.v.shape} must be [L, B, {len(self.tokens)}, K, H]")

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(a.nbytes for a in self.logits.values())

    def segment(self, start: int, stop: int) -> dict:
        return {"k": self.k[:, :, start:stop], "v": self.v[:, :, start:stop]}


# ---- one file ------------------------------------------------------------------------------------------
def _checksum(manifest: dict, tensors: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    h = hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=32)
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"\0{name}\0{a.dtype.name}\0{a.shape}\0".encode())
        h.update(memoryview(a).cast("B"))
    return "blake2b:" + h.hexdigest()


def _storable(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a if a.dtype.name in _STORABLE else a.view(f"uint{8 * a.dtype.itemsize}")  # bfloat16 -> uint16


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # a jax dependency: bfloat16 and friends

        return np.dtype(getattr(ml_dtypes, name))


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_snapshot(path, snap: Snapshot, ident: dict) -> int:
    """Write `snap` to `path` atomically; returns the file's size in bytes."""
    from safetensors.numpy import save_file

    path = Path(path)
    lengths = sorted(snap.logits)
    tensors = {"k": snap.k, "v": snap.v}
    if lengths:
        tensors["logits"] = np.stack([np.asarray(snap.logits[n]) for n in lengths])
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "model": ident["model"],
                "tokenizer": ident["tokenizer"], "salt": snap.salt, "tokens": list(snap.tokens),
                "length": snap.length, "logits_at": lengths,
                "dtypes": {name: np.asarray(a).dtype.name for name, a in tensors.items()}}
    stored = {name: _storable(np.asarray(a)) for name, a in tensors.items()}
    manifest["checksum"] = _checksum(manifest, stored)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as for open()
    try:
        save_file(stored, tmp, metadata={MANIFEST_KEY: json.dumps(manifest)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path.stat().st_size


def read_manifest(path, ident: dict | None = None) -> dict:
    """The manifest of a snapshot file (the header only: cheap). With `ident`, refuses (SnapshotError)
    a file of another format version, model or tokenizer."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise SnapshotError(f"{path} does not exist") from None
    except OSError as e:
        raise SnapshotError(f"{path} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # SafetensorError: truncated, not safetensors, bad header
        raise SnapshotError(f"{path} is truncated or corrupted ({e})") from None
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except (KeyError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path} is not a jaxsmol prefix snapshot")
    if manifest.get("version") != FORMAT_VERSION:
        raise SnapshotError(f"{path} has snapshot format version {manifest.get('version')!r}; "
                            f"this jaxsmol reads version {FORMAT_VERSION}")
    if ident is not None:
        _check_identity(path, manifest, ident)
    return manifest


def _check_identity(path, manifest: dict, ident: dict) -> None:
    if manifest.get("model") != ident["model"]:
        raise SnapshotError(f"{path} was made by another model (fingerprint {str(manifest.get('model'))[:12]}, "
                            f"this model {ident['model'][:12]}: config, dtype or weights differ)")
    if manifest.get("tokenizer") != ident["tokenizer"]:
        raise SnapshotError(f"{path} was made with another tokenizer or chat template "
                            f"({str(manifest.get('tokenizer'))[:12]}, this one {ident['tokenizer'][:12]})")


def load_snapshot(path, ident: dict, prompt=None) -> Snapshot:
    """Read and verify a snapshot file (see the module docstring); with `prompt`, also refuse a
    snapshot that shares no prefix with it. Raises SnapshotError naming the reason."""
    from safetensors import safe_open

    path = Path(path)
    manifest = read_manifest(path)
    try:
        with safe_open(path, framework="np") as f:
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        raise SnapshotError(f"{path} is truncated or corrupted ({e})") from None
    if manifest.get("checksum") != _checksum(manifest, stored):
        raise SnapshotError(f"{path} is corrupted (checksum mismatch)")
    _check_identity(path, manifest, ident)  # after the checksum: a flipped byte reads as corruption
    try:
        tensors = {name: stored[name].view(_dtype(manifest["dtypes"][name])) for name in stored}
        for a in tensors.values():
            a.flags.writeable = False  # snapshots are shared, like the in-memory ones
        lengths = [int(n) for n in manifest["logits_at"]]
        logits = dict(zip(lengths, tensors["logits"])) if lengths else {}
        snap = Snapshot(tokens=manifest["tokens"], k=tensors["k"], v=tensors["v"], logits=logits,
                        salt=str(manifest.get("salt", "")))
        if snap.length != manifest["length"] or not all(0 < n <= snap.length for n in lengths):
            raise ValueError("length or logits_at do not match the tokens")
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{path} is malformed ({type(e).__name__}: {e})") from None
    if prompt is not None and common_prefix_len(snap.tokens, prompt) == 0:
        raise SnapshotError(f"{path} does not match the prompt: its {snap.length} tokens share no prefix with it")
    return snap


# ---- --prompt-cache FILE: one snapshot a file ---------------------------------------------------------
@dataclasses.dataclass
class PromptCacheReport:
    file: str
    loaded: int = 0  # tokens of the snapshot put in the cache
    refused: str | None = None  # why the file was not used
    saved: int = 0  # tokens written back

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_prompt_cache(cache, path, prompt) -> PromptCacheReport:
    """Put the snapshot in `path` (if there is one) into `cache`; a refused file is reported, not raised."""
    report = PromptCacheReport(file=str(path))
    if not Path(path).exists():
        return report
    try:
        snap = load_snapshot(path, identity(cache.engine), prompt)
    except SnapshotError as e:
        report.refused = str(e)
        return report
    cache.add_snapshot(snap, salt="")
    report.loaded = snap.length
    return report


def save_prompt_cache(cache, path, tokens, report: PromptCacheReport | None = None) -> int:
    """Write the cache's state of the longest stored prefix of `tokens` to `path` (one snapshot)."""
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


class DiskStore:
    """Snapshot files in one directory, one per stored key, LRU under `budget_bytes`.

    The index (salt, tokens, size of every usable file) is read from the headers when opened. Only
    files named like its own (`<32 hex digits>.safetensors`) are considered; of those, files of another
    model, tokenizer or format version are left alone and not counted (another daemon may share the
    directory), and unreadable ones are deleted. `skipped` lists both, with reasons.
    """

    def __init__(self, directory, ident: dict, budget_bytes: int = 4 << 30):
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
        self.writes = self.loads = self.refused = 0
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
            m = read_manifest(p, self.ident)
        except SnapshotError as e:
            self.skipped.append((p.name, str(e)))
            if "truncated or corrupted" in str(e) or "not a jaxsmol" in str(e):
                with contextlib.suppress(OSError):
                    p.unlink()
            return
        st = p.stat()
        self.entries[p.name] = DiskEntry(p, str(m.get("salt", "")), tuple(m["tokens"]), tuple(m["logits_at"]),
                                         st.st_size, st.st_mtime)

    def name_of(self, salt: str, tokens) -> str:
        key = json.dumps([self.ident["model"], self.ident["tokenizer"], salt, [int(t) for t in tokens]])
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX

    @property
    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

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

    def put(self, snap: Snapshot) -> bool:
        """Store `snap` (evicting the least recently used files to make room); False if it cannot fit."""
        name = self.name_of(snap.salt, snap.tokens)
        if name in self.entries:
            self._touch(self.entries[name])
            return True
        if snap.nbytes > self.budget_bytes:
            return False
        while self.entries and self.bytes_held + snap.nbytes > self.budget_bytes:
            self._drop(min(self.entries, key=lambda n: self.entries[n].last_used))
        path = self.dir / name
        size = save_snapshot(path, snap, self.ident)
        self.entries[name] = DiskEntry(path, snap.salt, snap.tokens, tuple(sorted(snap.logits)), size, time.time())
        self.writes += 1
        return True

    def find(self, salt: str, prompt) -> tuple[DiskEntry | None, int]:
        """The entry sharing the longest prefix with `prompt` (ties: one with logits there), and that length."""
        best, best_key = None, (0, False)
        for e in self.entries.values():
            if e.salt != salt:
                continue
            n = common_prefix_len(e.tokens, prompt)
            key = (n, n in e.logits_at)
            if n and key > best_key:
                best, best_key = e, key
        return best, best_key[0]

    def load(self, entry: DiskEntry, prompt=None) -> Snapshot:
        """Read and verify an entry; a refused one leaves the index (and, if corrupted, the disk)."""
        try:
            snap = load_snapshot(entry.path, self.ident, prompt)
        except SnapshotError:
            self.refused += 1
            self._drop(entry.path.name)
            raise
        self.loads += 1
        self._touch(entry)
        return snap

    def newest_first(self) -> list[DiskEntry]:
        return sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True)

    def clear(self) -> None:
        for name in list(self.entries):
            self._drop(name)
