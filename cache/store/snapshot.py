"""A prefix snapshot and its file: one safetensors file a snapshot.

A file holds a snapshot's keys and values trimmed to its length (`k`, `v`: [L, B, K, n, H]), the
logits after some of its prefixes (`logits`: [P, V], the lengths in the manifest's `logits_at`, at
most MAX_LOGITS_ROWS of them), and a JSON manifest in the safetensors metadata:

    format, version      "jaxsmol.prefix-snapshot", FORMAT_VERSION
    model                Engine.fingerprint (config, dtype, every weight byte)
    tokenizer            Tokenizer.fingerprint (tokenizer.json bytes + chat template), "none" without one
    salt                 the cache namespace's salt ("" unless a tenant set one)
    pinned               (optional, default false) a pinned prefix: the daemon pins it again at start
    expires_at           (optional) when it expires (seconds since the epoch): a pinned one is pinned again
                         for what is left (a named cached content, its `record` too); an unpinned one is
                         retained on disk until then (`prompt_cache_retention`), out of the LRU's reach
    record               (optional) a named cached content's record (cache/named.py)
    tokens, length       the token ids the state was computed from, and how many
    logits_at, dtypes    prefix lengths that have logits; each tensor's dtype (bfloat16 is stored as uint16)
    checksum             blake2b over this manifest (checksum left out) and every tensor's name, dtype,
                         shape and bytes

`load_snapshot` refuses (SnapshotError, one line naming why) a file larger than the engine could have
written (`max_snapshot_bytes`, checked before anything is read), one that does not parse, is truncated,
has another format version, fails its checksum, comes from another model or tokenizer, holds arrays of
other dimensions or dtypes than the engine's, or shares no prefix with the prompt. A caller then takes
the cold path, which is always correct.

Writes are atomic: a temporary file in the same directory, fsync, `os.replace`, fsync of the
directory. A crash at any point leaves either the old file or the new one, never half of one
(temporary files are named `.NAME.*.tmp` and never loaded). Files are created with mode 0600: they
hold tenants' prompt ids. `is_snapshot_file` tells a file that a new snapshot may replace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
from pathlib import Path

import numpy as np

from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.system.durable import fsync_dir
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv_layout import SEQ_AXIS, seq_index

FORMAT = "jaxsmol.prefix-snapshot"
FORMAT_VERSION = 2  # 2: keys and values heads-first, [L, B, K, n, H] (1 was [L, B, n, K, H])
MANIFEST_KEY = "jaxsmol"
MAX_LOGITS_ROWS = 64  # logits kept per file (the longest prefixes'): bounds a file's size
_MAX_HEADER = 100 << 20  # as safetensors: a larger header is no snapshot
_STORABLE = {"float64", "float32", "float16", "int64", "uint64", "int32", "uint32", "int16", "uint16",
             "int8", "uint8", "bool"}


class SnapshotError(JaxsmolError):
    """A snapshot file that must not be used; the message says why, `reason` in one word: "checksum"
    (its bytes do not add up), "corrupted" (truncated, malformed, not a snapshot), "unreadable" (the OS
    would not read it) or "mismatch" (intact, of another model, format or shape)."""

    def __init__(self, message: str, reason: str = "mismatch"):
        super().__init__(message)
        self.reason = reason


def identity(engine) -> dict:
    """What a snapshot must have been made with to be used by `engine`: model and tokenizer fingerprints,
    and (checked on load, before use) the shape [L, B, K, H] and dtype of its keys and values, the
    vocabulary of its logits, the longest sequence and the largest file the engine could have written."""
    tok, cfg = engine.tokenizer, engine.cfg
    tok_fp = "none" if tok is None else (getattr(tok, "fingerprint", None) or f"unhashed:{type(tok).__name__}")
    return {"model": engine.fingerprint, "tokenizer": tok_fp,
            "kv_dims": (cfg.n_layers, 1, cfg.n_kv_heads, cfg.head_dim),
            "kv_dtype": np.dtype(engine.cache_dtype).name, "matmul": cfg.matmul, "vocab": cfg.vocab_size,
            "ctx": engine.ctx,
            "max_bytes": max_snapshot_bytes(engine)}


def max_snapshot_bytes(engine) -> int:
    """The size cap of a snapshot file for `engine`: ctx positions of keys and values, MAX_LOGITS_ROWS
    rows of float32 logits, and the header (each token id under 16 bytes of JSON, plus 1 MiB)."""
    return engine.ctx * (engine.kv_bytes_per_token + 16) + MAX_LOGITS_ROWS * 4 * engine.cfg.vocab_size + (1 << 20)


@dataclasses.dataclass
class Snapshot:
    """The state of `tokens`: keys and values [L, B, K, n, H] and the logits after some prefixes."""
    tokens: tuple
    k: np.ndarray
    v: np.ndarray
    logits: dict = dataclasses.field(default_factory=dict)  # prefix length -> logits [V] after its last token
    salt: str = ""
    pinned: bool = False  # a pinned prefix (kept out of eviction, pinned again at start)
    expires_at: float | None = None  # seconds since the epoch: a pin's expiry, or an unpinned file's retention
    record: dict | None = None  # a named cached content's record (cache/named.py)

    def __post_init__(self):
        self.tokens = tuple(int(t) for t in self.tokens)
        if not (self.k.shape == self.v.shape and self.k.ndim == 5 and self.k.shape[SEQ_AXIS] == len(self.tokens)):
            raise ValueError(f"k {self.k.shape} and v {self.v.shape} must be [L, B, K, {len(self.tokens)}, H]")

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(a.nbytes for a in self.logits.values())

    def segment(self, start: int, stop: int) -> dict:
        return {"k": self.k[seq_index(start, stop)], "v": self.v[seq_index(start, stop)]}


# ---- one file ------------------------------------------------------------------------------------------
def checksum(manifest: dict, tensors: dict) -> str:
    """blake2b over the manifest (its own checksum left out) and every tensor's name, dtype, shape, bytes."""
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


def _dtype(name) -> np.dtype:
    """The dtype named `name` (a NumPy or ml_dtypes name); ValueError for anything else."""
    import ml_dtypes  # a jax dependency: bfloat16 and friends

    if not isinstance(name, str) or not (name in _STORABLE or isinstance(getattr(ml_dtypes, name, None), type)):
        raise ValueError(f"unknown dtype {name!r}")
    try:
        return np.dtype(name) if name in _STORABLE else np.dtype(getattr(ml_dtypes, name))
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def save_snapshot(path, snap: Snapshot, ident: dict) -> int:
    """Write `snap` to `path` atomically; returns the file's size in bytes."""
    path = Path(path)
    lengths = sorted(snap.logits)[-MAX_LOGITS_ROWS:]
    tensors = {"k": snap.k, "v": snap.v}
    if lengths:
        tensors["logits"] = np.stack([np.asarray(snap.logits[n]) for n in lengths])
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "model": ident["model"], "matmul": ident.get("matmul"),
                "tokenizer": ident["tokenizer"], "salt": snap.salt, "tokens": list(snap.tokens),
                "length": snap.length, "logits_at": lengths,
                "dtypes": {name: np.asarray(a).dtype.name for name, a in tensors.items()}}
    if snap.pinned:
        manifest["pinned"] = True
    manifest.update(marks(snap.expires_at, snap.record))
    return _write(path, {name: _storable(np.asarray(a)) for name, a in tensors.items()}, manifest)


def marks(expires_at: float | None, record: dict | None) -> dict:
    """The manifest's optional `expires_at` and `record` fields (none when unset)."""
    out = {} if expires_at is None else {"expires_at": round(float(expires_at), 3)}
    return out | ({} if record is None else {"record": record})


def set_pinned(path, pinned: bool) -> None:
    """Mark the snapshot file `path` pinned or not (its data verified first, the file rewritten
    atomically; an expiry and a record dropped); SnapshotError for a file that is not an intact snapshot."""
    path = Path(path)
    manifest, stored = _read_verified(path)
    for mark in ("pinned", "expires_at", "record"):
        manifest.pop(mark, None)
    if pinned:
        manifest["pinned"] = True
    _write(path, stored, manifest)


def _write(path: Path, stored: dict, manifest: dict) -> int:
    """Write tensors and manifest (its checksum computed here) to `path` atomically; the file's size."""
    from safetensors.numpy import save_file

    manifest = {k: v for k, v in manifest.items() if k != "checksum"}
    manifest["checksum"] = checksum(manifest, stored)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # prompt ids: the owner's only
    try:
        save_file(stored, tmp, metadata={MANIFEST_KEY: json.dumps(manifest)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
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
        raise SnapshotError(f"{path} does not exist", "unreadable") from None
    except OSError as e:
        raise SnapshotError(f"{path} cannot be read ({e.strerror or e})", "unreadable") from None
    except Exception as e:  # SafetensorError: truncated, not safetensors, bad header
        raise SnapshotError(f"{path} is truncated or corrupted ({e})", "corrupted") from None
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except (KeyError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path} is not a jaxsmol prefix snapshot", "corrupted")
    if manifest.get("version") != FORMAT_VERSION:
        raise SnapshotError(f"{path} has snapshot format version {manifest.get('version')!r}; "
                            f"this jaxsmol reads version {FORMAT_VERSION}")
    if ident is not None:
        _check_identity(path, manifest, ident)
    return manifest


def is_snapshot_file(path) -> bool:
    """Whether `path` is a regular file whose header says it is a jaxsmol prefix snapshot (of any version,
    model or tokenizer; its data may be damaged): the only kind of existing file a snapshot may replace."""
    try:
        if not Path(path).is_file():  # before open(): opening a FIFO would block
            return False
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
                return False
            manifest = json.loads(json.loads(f.read(n))["__metadata__"][MANIFEST_KEY])
        return manifest.get("format") == FORMAT
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _check_size(path: Path, ident: dict) -> None:
    cap = ident.get("max_bytes")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise SnapshotError(f"{path} cannot be read ({e.strerror or e})", "unreadable") from None
    if cap is not None and size > cap:
        raise SnapshotError(f"{path} is {size} bytes, more than this engine could have written ({cap}: "
                            f"its context of {ident['ctx']} tokens, {MAX_LOGITS_ROWS} logits rows, the header)")


def _check_dims(path, snap: Snapshot, ident: dict) -> None:
    """Refuse arrays the engine cannot use (a file may carry the right fingerprint and other shapes)."""
    if "kv_dims" not in ident:
        return
    want = list(ident["kv_dims"])  # [L, B, K, H]
    want.insert(SEQ_AXIS, snap.length)
    want = tuple(want)
    if snap.k.shape != want or snap.k.dtype.name != ident["kv_dtype"] or snap.v.dtype != snap.k.dtype:
        raise SnapshotError(f"{path} holds keys/values {snap.k.dtype.name} {list(snap.k.shape)}; this engine "
                            f"needs {ident['kv_dtype']} {list(want)}")
    if snap.length > ident["ctx"]:
        raise SnapshotError(f"{path} holds {snap.length} tokens, more than this engine's context ({ident['ctx']})")
    for row in snap.logits.values():
        if row.shape != (ident["vocab"],) or row.dtype != np.float32:
            raise SnapshotError(f"{path} holds logits {row.dtype.name} {list(row.shape)}; this engine needs "
                                f"float32 [{ident['vocab']}]")


def _check_identity(path, manifest: dict, ident: dict) -> None:
    if manifest.get("model") != ident["model"]:
        kv_dtype = (manifest.get("dtypes") or {}).get("k")
        if isinstance(kv_dtype, str) and kv_dtype != ident.get("kv_dtype", kv_dtype):  # say why when it is that
            raise SnapshotError(f"{path} holds a {kv_dtype} KV cache; "
                                f"this engine's is {ident['kv_dtype']} (--kv-dtype)")
        matmul = manifest.get("matmul")
        if isinstance(matmul, str) and matmul != ident.get("matmul", matmul):
            raise SnapshotError(f"{path} was computed with --matmul {matmul}; this engine runs --matmul "
                                f"{ident['matmul']} (their states differ in the last bits)")
        raise SnapshotError(f"{path} was made by another model (fingerprint {str(manifest.get('model'))[:12]}, "
                            f"this model {ident['model'][:12]}: config, dtype, weights or the kernels' "
                            "numerics differ)")
    if manifest.get("tokenizer") != ident["tokenizer"]:
        raise SnapshotError(f"{path} was made with another tokenizer or chat template "
                            f"({str(manifest.get('tokenizer'))[:12]}, this one {ident['tokenizer'][:12]})")


def _read_verified(path: Path) -> tuple[dict, dict]:
    """(manifest, stored tensors) of a snapshot file whose checksum holds; SnapshotError otherwise."""
    from safetensors import safe_open

    manifest = read_manifest(path)
    try:
        with safe_open(path, framework="np") as f:
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        raise SnapshotError(f"{path} is truncated or corrupted ({e})", "corrupted") from None
    if manifest.get("checksum") != checksum(manifest, stored):
        raise SnapshotError(f"{path} is corrupted (checksum mismatch)", "checksum")
    return manifest, stored


def load_snapshot(path, ident: dict, prompt=None) -> Snapshot:
    """Read and verify a snapshot file (see the module docstring); with `prompt`, also refuse a
    snapshot that shares no prefix with it. Raises SnapshotError naming the reason."""
    path = Path(path)
    _check_size(path, ident)  # before anything is read
    manifest, stored = _read_verified(path)
    _check_identity(path, manifest, ident)  # after the checksum: a flipped byte reads as corruption
    try:
        tensors = {name: stored[name].view(_dtype(manifest["dtypes"][name])) for name in stored}
        for a in tensors.values():
            a.flags.writeable = False  # snapshots are shared, like the in-memory ones
        lengths = [int(n) for n in manifest["logits_at"]]
        if lengths and (len(set(lengths)) != len(lengths) or len(tensors["logits"]) != len(lengths)):
            raise ValueError("logits_at does not match the logits rows")
        logits = dict(zip(lengths, tensors["logits"])) if lengths else {}
        snap = Snapshot(tokens=manifest["tokens"], k=tensors["k"], v=tensors["v"], logits=logits,
                        salt=str(manifest.get("salt", "")), pinned=manifest.get("pinned") is True)
        if snap.length != manifest["length"] or not all(0 < n <= snap.length for n in lengths):
            raise ValueError("length or logits_at do not match the tokens")
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{path} is malformed ({type(e).__name__}: {e})", "corrupted") from None
    _check_dims(path, snap, ident)
    if prompt is not None and common_prefix_len(snap.tokens, prompt) == 0:
        raise SnapshotError(f"{path} does not match the prompt: its {snap.length} tokens share no prefix with it")
    return snap
