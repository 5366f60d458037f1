"""The KV cache: an immutable pytree of keys, values and the number of positions written.

    k, v: [L, B, K, S, H]  (layers, batch, kv heads, slots, head dim); S is the allocated capacity
    pos:  int32 []         positions 0..pos-1 hold this sequence's keys/values

Heads before slots: attention reads a block of slots as [B, K, C, H], the batch-major layout of XLA's
batched matmul, so no block is transposed (copied) before its two products (measured on the decode
attention over 2000 positions: 0.73x the time of the [L, B, S, K, H] layout, the same bits). Code
outside the forward slices slots with `seq_index`, never with a hard-coded axis.

Slots at or beyond `pos` may hold stale values (padding of a chunk, or an older, longer sequence
that a snapshot came from). They never influence a result: a query at position q attends only to
key positions <= q, and every such position was written for this sequence before the query ran
(restored from the snapshot, or written by the same forward call before attention). So masking by
position is enough; nothing is ever cleared.

A *snapshot* is the same pytree trimmed to its length and held in host memory as read-only NumPy
arrays (`trim`); `load_prefix` writes one back into a device cache (see `Engine.restore`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.kernels import cpu_copies
from jaxsmol.model.config import Config
from jaxsmol.model.kv_layout import SEQ_AXIS, seq_index  # noqa: F401 (the API's)
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.sharding import kv_sharding


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    pos: jax.Array  # int32 []

    @classmethod
    def zeros(cls, cfg: Config, capacity: int, batch: int = 1, dtype=jnp.float32, mesh=None) -> KVCache:
        """An empty cache; with a mesh, placed as `sharding.kv_sharding` says."""
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        device = None if mesh is None else kv_sharding(mesh, shape)
        return cls(k=jnp.zeros(shape, dtype, device=device), v=jnp.zeros(shape, dtype, device=device),
                   pos=jnp.zeros((), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[SEQ_AXIS]

    @property
    def rows(self) -> int:  # a decode batch's width; 1 for one sequence's cache
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def segment(self, start: int, stop: int) -> dict:
        """Positions [start, stop) as read-only host arrays {"k", "v"}: [L, B, K, stop-start, H].

        A copy, so the device buffer may be donated afterwards; snapshots are shared between
        requests, so they are made read-only."""
        assert 0 <= start <= stop <= int(self.pos), (start, stop, int(self.pos))

        def cut(a):
            out = np.array(np.asarray(a)[seq_index(start, stop)])  # np.array copies
            out.flags.writeable = False
            return out

        return {"k": cut(self.k), "v": cut(self.v)}

    def trim(self, length: int) -> KVCache:
        """A host snapshot of the first `length` positions (see `segment`)."""
        return KVCache.from_segment(self.segment(0, length))

    @classmethod
    def from_segment(cls, seg: dict) -> KVCache:
        """A host snapshot from a segment that starts at position 0."""
        return cls(k=seg["k"], v=seg["v"], pos=np.int32(seg["k"].shape[SEQ_AXIS]))


def check_snapshot(snapshot: KVCache, cfg: Config, n: int) -> None:
    """Raise JaxsmolError unless snapshot's k and v are one row of cfg's cache holding >= n slots:
    [L, 1, K, >= n, H]."""
    want = (cfg.n_layers, 1, cfg.n_kv_heads, cfg.head_dim)
    for name, a in (("k", snapshot.k), ("v", snapshot.v)):
        got = tuple(a.shape[:SEQ_AXIS]) + tuple(a.shape[SEQ_AXIS + 1:])
        if len(a.shape) != 5 or got != want or not 0 <= n <= a.shape[SEQ_AXIS]:
            raise JaxsmolError(f"snapshot {name} has shape {tuple(a.shape)}; this engine restores "
                               f"[L, B, K, S, H] = [{want[0]}, 1, {want[2]}, >= {n}, {want[3]}]")


def aligned_host_prefix(a: np.ndarray, n: int, multiple: int, alloc=None) -> np.ndarray:
    """The first n positions of a host k or v [L, B, K, >=n, H], zero-padded to a multiple of
    `multiple` slots (bounding the shapes `load_prefix` compiles for), in 64-byte aligned memory so
    that `jax.device_put(..., may_alias=True)` can use it without a copy on CPU. `alloc(nbytes)`
    returns the uint8 memory to use (at least nbytes); a fresh buffer when None."""
    P = -(-n // multiple) * multiple
    shape = a.shape[:SEQ_AXIS] + (P,) + a.shape[SEQ_AXIS + 1:]
    nbytes = int(np.prod(shape)) * a.dtype.itemsize
    raw = (alloc or (lambda size: np.empty(size, np.uint8)))(nbytes + 64)
    offset = (-raw.ctypes.data) % 64
    out = raw[offset:offset + nbytes].view(a.dtype).reshape(shape)
    out[seq_index(0, n)] = a[seq_index(0, n)]
    out[seq_index(n)] = 0  # finite: masked slots must never hold NaN (0 * NaN would leak through)
    return out


def load_prefix(kv: KVCache, k: jax.Array, v: jax.Array, length: jax.Array, kernel: bool = False) -> KVCache:
    """kv with k, v [L, B, K, P, H] written at slot 0 and pos = length (slots past it are stale).
    kernel: by the CPU kernel (cpu_copies.load_prefix: both threads), else XLA's dynamic-update-slice."""
    def write(cache, prefix):
        prefix = prefix.astype(cache.dtype)
        return (cpu_copies.load_prefix(cache, prefix) if kernel
                else jax.lax.dynamic_update_slice(cache, prefix, (0,) * 5))

    return KVCache(k=write(kv.k, k), v=write(kv.v, v), pos=length.astype(jnp.int32))
