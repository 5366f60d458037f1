"""The shared KV store: a third tier below memory and disk that several daemons, on one machine or many,
read and write (`jaxsmol serve --shared-cache DIR|redis://HOST:PORT[/DB]`). Content-keyed chunks of
prompts' KV state; the backends (a directory, Redis) are in cache/store/shared_backends.py, and the
prefix cache (cache/prefix_cache.py) calls `read_run` on a lookup and `write_missing` after a save.

A chunk is CHUNK_TOKENS (64) positions. Chunk i's key is a chain, key_i = blake2b(key_{i-1}, token ids
of chunk i), from key_-1 = blake2b(format version, chunk size, the model's identity, the namespace's
salt): it names every token up to the end of chunk i, so any daemon finds any prefix it shares, and the
identity (`model_identity`: Engine.fingerprint, which hashes config, dtype, weights and the numerics'
sources; the tokenizer, KV dims and dtype, --matmul; and the kernels class: the C++ kernels' vector
width, or XLA's backend, device and the CPU's vector flags) keeps apart daemons whose states differ in
a bit. A restore at any position is exact (docs/design.md: a prompt row's bits do not depend on the chunk
that carries it), so chunk boundaries need no alignment with the prefill buckets.

Why 64 (LMCache's 256 is for GPUs): what a replica still prefills is the prompt's tail past its last whole
chunk, up to C - 1 positions, and on a CPU that costs far more than moving a chunk. Measured on 2 cores
(tools/time_shared_cache.py, a 2000-token prefix of the 135M, float32 KV: 46 kB a position), B's time to
first token from a directory was 532 ms at C = 64, 796 at 128, 943 at 256, 1075 at 512 (its cold prefill
3-4 s), from Redis 592, 621, 866 and 1237 ms; reads ran at 450-640 MB/s whatever C, so a chunk's own
costs (its key, a round trip, a file) do not show at 64. Below 64 the gain ends where XLA's exact chunks
start (a tail of 1-64 positions costs one 64-row chunk there).

Writes: `write_through` queues a prompt's chunks for a writer thread (WRITE_QUEUE prompts at most; beyond
that they are dropped, counted "busy"), which checks which exist and writes the others: a 2000-token
prompt's write-through took 190-420 ms, which on the request's thread would delay every stream's next
decode step.

A value: MAGIC, a little-endian u32 header length, a JSON header (format version, key, the chunk's token
ids, dtype, shape [L, 1, K, C, H]), the keys' bytes, the values' bytes, and a SHA-256 over all of it
(SHA-256 for the values, not blake2b: CPUs hash it in hardware, 1.8 GB/s here against 0.8, and every
restored chunk is hashed on the request's path).
`decode` refuses, with a reason (`Refused.reason`), a value that is shorter than its header says
("truncated"), whose checksum fails ("checksum"), whose header does not parse ("malformed"), or which is
intact but not this key's (another key, tokens, version, dtype or shape: "foreign"). A refused value is
counted, deleted so that the next writer replaces it, and never restored.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from collections import Counter

import numpy as np

from jaxsmol.cache.store.shared_backends import BackendError, open_backend
from jaxsmol.cache.store.snapshot import _dtype, identity
from jaxsmol.model.kv_layout import SEQ_AXIS, seq_index
from jaxsmol.system import host_memory

CHUNK_TOKENS = 64
WRITE_QUEUE = 16  # prompts waiting for the writer thread
READERS = 2  # chunks a lookup reads at once (reader threads)
FORMAT_VERSION = 1
MAGIC = b"JXSMOLKV"
_HEAD = struct.Struct("<8sI")  # magic, header length
_SUM = 32  # SHA-256 checksum bytes
LOGGER = logging.getLogger("jaxsmol.cache")


class Refused(Exception):
    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def kernels_class(engine) -> str:
    """What decides a state's last bits beyond the model: the C++ kernels' vector width, or XLA's backend,
    device kind and the CPU's vector instruction sets (XLA compiles for the host's)."""
    import jax

    if engine.cfg.cpu_kernels:
        from jaxsmol.kernels.cpu_kernels import vector_lanes

        return f"cpu-kernels lanes={vector_lanes()}"
    from jaxsmol.kernels.cpu_identity import _cpu_flags

    flags = sorted(f for f in (_cpu_flags() or ()) if f.startswith(("avx", "fma", "amx", "sse4")))
    return f"xla {jax.default_backend()} {jax.devices()[0].device_kind} {' '.join(flags)}"


def model_identity(engine) -> dict:
    """The fields of `identity(engine)` that decide a state's bits (not the context nor the file cap),
    with the kernels class: what SharedStore keys hash."""
    ident = identity(engine)
    fields = {k: ident[k] for k in ("model", "tokenizer", "kv_dims", "kv_dtype", "matmul", "vocab")}
    return {**fields, "kernels": kernels_class(engine)}


def _h(*parts: bytes) -> hashlib.blake2b:
    h = hashlib.blake2b(digest_size=32)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike
        h.update(p)
    return h


def chunk_keys(ident: dict, salt: str, tokens, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The keys of the whole chunks of `tokens` (hex), each naming the identity, salt and every token before
    its end."""
    root = json.dumps({"format": FORMAT_VERSION, "chunk": chunk_tokens, "identity": ident}, sort_keys=True)
    key = _h(root.encode(), salt.encode()).digest()
    ids = np.asarray(tokens, dtype="<i4")
    out = []
    for i in range(len(ids) // chunk_tokens):
        key = _h(key, ids[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes()).digest()
        out.append(key.hex())
    return out


def encode(key: str, ids, k: np.ndarray, v: np.ndarray) -> bytes:
    """A chunk's value (the module docstring's layout)."""
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    header = json.dumps({"version": FORMAT_VERSION, "key": key, "tokens": [int(t) for t in ids],
                         "dtype": k.dtype.name, "shape": list(k.shape)}).encode()
    body = b"".join((_HEAD.pack(MAGIC, len(header)), header, memoryview(k).cast("B"), memoryview(v).cast("B")))
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, key: str, ids, dtype: np.dtype, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(k, v) of the value `data` read under `key` for the chunk `ids`, read-only arrays over `data` (its
    keys' and values' bytes: over a backend's pages they own their memory); Refused naming why it must
    not be used."""
    if len(data) < _HEAD.size:
        raise Refused(f"{len(data)} bytes, shorter than a value's head", "truncated")
    magic, header_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise Refused("not a jaxsmol shared KV value (no magic)", "foreign")
    nbytes = int(np.prod(shape)) * dtype.itemsize
    want = _HEAD.size + header_len + 2 * nbytes + _SUM
    if len(data) != want:
        raise Refused(f"{len(data)} bytes where this chunk's value has {want}",
                      "truncated" if len(data) < want else "foreign")
    view = memoryview(data)
    if hashlib.sha256(view[:-_SUM]).digest() != view[-_SUM:]:
        raise Refused("checksum mismatch", "checksum")
    try:
        header = json.loads(bytes(view[_HEAD.size:_HEAD.size + header_len]))
        fields = (header["version"], header["key"], header["tokens"], header["dtype"], list(header["shape"]))
    except (ValueError, KeyError, TypeError) as e:
        raise Refused(f"malformed header ({type(e).__name__}: {e})", "malformed") from None
    if fields != (FORMAT_VERSION, key, [int(t) for t in ids], dtype.name, list(shape)):
        raise Refused(f"the value of another chunk (key {str(header.get('key'))[:12]}, version {fields[0]}, "
                      f"{fields[3]} {fields[4]})", "foreign")
    start = _HEAD.size + header_len
    k, v = (np.ndarray(shape, dtype, buffer=data, offset=at) for at in (start, start + nbytes))
    k.flags.writeable = v.flags.writeable = False
    return k, v


class SharedStore:
    """Chunks of prompts' KV state in a backend, keyed by content (module docstring). Never raises for the
    backend's faults: a read that fails is a miss, a write that fails is dropped, both counted. Reads run
    on reader threads, READERS chunks at once, and are counted on the caller's thread; writes run on the
    writer thread with background=True (each counter has one writer)."""

    def __init__(self, backend, ident: dict, chunk_tokens: int = CHUNK_TOKENS, background: bool = False,
                 write_back: bool = False):
        """write_back: a prompt's chunks are written when memory evicts it (and at shutdown), not once it is
        computed (write-through): fewer writes, later seen by the other daemons."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.backend, self.ident, self.chunk_tokens, self.write_back = backend, ident, chunk_tokens, write_back
        L, B, K, H = ident["kv_dims"]
        self.dtype = _dtype(ident["kv_dtype"])
        self.shape = [L, B, K, H]
        self.shape.insert(SEQ_AXIS, chunk_tokens)
        self.shape = tuple(self.shape)
        self.hits = self.misses = self.writes = self.bytes_read = self.bytes_written = 0
        self.read_s = 0.0  # the time of the reads counted in bytes_read
        self.refused: Counter = Counter()  # Refused.reason -> values refused (and deleted)
        self.dropped: Counter = Counter()  # BackendError.reason (or "busy": the queue full) -> chunks not written
        self.unavailable = 0  # reads that found the backend unreachable
        self._queue: queue.Queue | None = None
        self._readers = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="jaxsmol-shared-reads")
        self._dropping = threading.Lock()  # `dropped` counts on both threads
        self.on_written = None  # called after each queued prompt's writes (the cache copies the counts)
        if background:
            self._queue = queue.Queue(WRITE_QUEUE)
            threading.Thread(target=self._writer, name="jaxsmol-shared-writes", daemon=True).start()

    def describe(self) -> str:
        return f"{self.backend.describe()}, chunks of {self.chunk_tokens} tokens"

    def keys(self, salt: str, tokens) -> list[str]:
        return chunk_keys(self.ident, salt, tokens, self.chunk_tokens)

    def read_run(self, keys: list[str], tokens, first: int) -> list[dict]:
        """{"k", "v"} of chunks first, first + 1, ... of `tokens` under `keys`, up to the first one missing,
        refused or unreadable: READERS chunks read at once on the reader threads, in order."""
        size, out, nbytes, started = self.chunk_tokens, [], 0, time.perf_counter()
        todo, jobs = iter(range(first, len(keys))), collections.deque()

        def more():
            i = next(todo, None)
            if i is not None:
                jobs.append(self._readers.submit(self._fetch, keys[i], tokens[i * size:(i + 1) * size]))
        for _ in range(READERS):
            more()
        while jobs:
            outcome, got, n = jobs.popleft().result()
            if outcome != "hit":
                self._count_failed(outcome, got)
                break
            out.append(got)
            self.hits += 1
            nbytes += n
            more()
        for job in jobs:  # read past the run's end: only a refused value counts (it was deleted)
            outcome, got, _ = job.result()
            if outcome == "refused":
                self.refused[got] += 1
        if nbytes:
            self.bytes_read += nbytes
            self.read_s += time.perf_counter() - started
        return out

    def _fetch(self, key: str, ids) -> tuple[str, object, int]:
        """One chunk, on a reader thread: ("hit", its {"k", "v"} in memory of their own, bytes read),
        ("miss" or "unavailable", None, 0), or ("refused", the reason, 0) for a value deleted as refused.
        Fetching, hashing and copying let other threads run: chunks are read side by side."""
        try:
            data = self.backend.get(key)
        except BackendError:
            return "unavailable", None, 0
        if data is None:
            return "miss", None, 0
        try:
            k, v = decode(data, key, ids, self.dtype, self.shape)
        except Refused as e:
            LOGGER.warning("shared cache: refused chunk %s (%s): %s", key[:16], e.reason, e)
            self.backend.delete(key)
            return "refused", e.reason, 0
        if not host_memory.owns(k):  # a reply in malloc's heap (redis-py's): kept by the store, it would fragment it
            k, v = host_memory.copy(k), host_memory.copy(v)
        return "hit", {"k": k, "v": v}, len(data)

    def _count_failed(self, outcome: str, reason) -> None:
        if outcome == "refused":
            self.refused[reason] += 1
        else:
            self.misses += 1
            self.unavailable += outcome == "unavailable"

    @property
    def read_rate(self) -> float | None:
        """Bytes a second its reads have taken (fetched, verified, decoded), None before the first."""
        return self.bytes_read / self.read_s if self.read_s > 0 else None

    @property
    def chunk_bytes(self) -> int:
        """A chunk's keys and values, in bytes (its value's header aside)."""
        return 2 * int(np.prod(self.shape)) * self.dtype.itemsize

    def write_missing(self, keys: list[str], tokens, segment) -> int:
        """Write the chunks under `keys` the backend lacks, their state from `segment(start, stop)` ({"k",
        "v"} of those positions); the number written."""
        try:
            present = self.backend.exists(keys)
        except BackendError as e:
            self._drop(e.reason, len(keys))
            return 0
        written = 0
        for i, (key, there) in enumerate(zip(keys, present)):
            if there:
                continue
            lo, hi = i * self.chunk_tokens, (i + 1) * self.chunk_tokens
            seg = segment(lo, hi)
            data = encode(key, tokens[lo:hi], np.asarray(seg["k"]), np.asarray(seg["v"]))
            try:
                self.backend.put(key, data)
            except BackendError as e:
                self._drop(e.reason, 1)
                continue
            written += 1
            self.bytes_written += len(data)
        self.writes += written
        return written

    def write_through(self, keys: list[str], tokens, segment) -> None:
        """`write_missing` now, or on the writer thread with background=True (`segment` must stay valid:
        immutable arrays); dropped and counted "busy" while WRITE_QUEUE prompts wait."""
        if self._queue is None:
            self.write_missing(keys, tokens, segment)
            return
        try:
            self._queue.put_nowait((keys, tokens, segment))
        except queue.Full:
            self._drop("busy", len(keys))

    def _drop(self, reason: str, chunks: int) -> None:
        with self._dropping:
            self.dropped[reason] += chunks

    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self.write_missing(*job)
                if self.on_written is not None:
                    self.on_written()
            except Exception:  # a write costs its chunks, never the thread
                LOGGER.exception("shared cache: a write failed")
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Until the queued writes are done."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self.drain()
        self._readers.shutdown()
        self.backend.close()


def segment_over(parts: list[dict], base: int = 0):
    """`segment(start, stop)` over consecutive segments {"k", "v"} ([L, B, K, n, H]) whose first starts at
    position `base`: the positions asked for, a copy where they span several (what RadixStore.insert and
    SharedStore.write_missing take)."""
    bounds, at = [], base
    for part in parts:
        bounds.append((at, part))
        at += part["k"].shape[SEQ_AXIS]

    def segment(start: int, stop: int) -> dict:
        pieces = [(max(start, lo) - lo, min(stop, lo + p["k"].shape[SEQ_AXIS]) - lo, p) for lo, p in bounds]
        pieces = [(a, b, p) for a, b, p in pieces if a < b]
        if len(pieces) == 1 and pieces[0][1] - pieces[0][0] == pieces[0][2]["k"].shape[SEQ_AXIS]:
            return pieces[0][2]  # a whole part as it is: no view for the store to copy
        return {name: pieces[0][2][name][seq_index(*pieces[0][:2])] if len(pieces) == 1 else
                np.concatenate([p[name][seq_index(a, b)] for a, b, p in pieces], axis=SEQ_AXIS)
                for name in ("k", "v")}

    return segment


def open_shared(spec: str, engine, chunk_tokens: int = CHUNK_TOKENS, budget_bytes: int | None = None,
                background: bool = False, write_back: bool = False) -> SharedStore:
    """The shared store at `spec` (a directory or redis://HOST:PORT[/DB]) for `engine`; JaxsmolError naming
    what is wrong with `spec` (a bad URL, an unreachable server, an unusable directory)."""
    return SharedStore(open_backend(spec, budget_bytes), model_identity(engine), chunk_tokens, background,
                       write_back)
