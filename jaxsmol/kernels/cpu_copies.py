"""The KV caches' copies in C++ (cpu_prefix.cc, built and loaded with the other kernels by cpu_kernels.py),
called from jitted programs through JAX's FFI.

`load_prefix`, `write_slots`, `read_slots`, `copy_row`: copies of a snapshot's prefix into a cache, of a
staged block into a row of the KV arena and of a row's slots out of it, of a row's slots into another,
split between the threads (XLA's dynamic-update-slice copies on one), none touching a slot past the
positions asked; `write_rows`: a chunk's keys or values into one layer of a bfloat16 cache, in place
(XLA:CPU widens its update-slice to float32, the whole cache there and back); `reserve`: the KV arena
allocated without touching its pages (XLA writes every byte it allocates), so that only the positions
written take memory (runtime/kv_arena.py). A copy changes no bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def load_prefix(cache: jax.Array, prefix: jax.Array) -> jax.Array:
    """cache [L, B, K, S, H] with prefix [L, B, K, P, H] (same dtype) written at slots 0..P-1, in
    place where the cache is donated (cpu_prefix.cc: the copy split between the threads)."""
    call = jax.ffi.ffi_call("jaxsmol_load_prefix", jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, prefix)


def write_slots(cache: jax.Array, block: jax.Array, row: jax.Array, start: jax.Array, n: jax.Array) -> jax.Array:
    """cache [L, R, K, S, H] with the first n slots of block [L, 1, K, P, H] (same dtype) written into row
    `row` from slot `start` (start + P <= S), in place where the cache is donated."""
    call = jax.ffi.ffi_call("jaxsmol_write_slots", jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, block, jnp.stack([row, start, n]).astype(jnp.int32))


def read_slots(cache: jax.Array, row: jax.Array, start: jax.Array, n: jax.Array, size: int) -> jax.Array:
    """Slots start..start + n - 1 of row `row` of cache [L, R, K, S, H] as a block [L, 1, K, size, H], zeros
    past them; no slot past them is read."""
    L, _, K, _, H = cache.shape
    call = jax.ffi.ffi_call("jaxsmol_read_slots", jax.ShapeDtypeStruct((L, 1, K, size, H), cache.dtype))
    return call(cache, jnp.stack([row, start, n]).astype(jnp.int32))


def write_rows(cache: jax.Array, new: jax.Array, layer: jax.Array, pos: jax.Array, rows: jax.Array) -> jax.Array:
    """cache [L, R, K, S, H] with new [B, T, K, H] (same dtype) written into layer `layer`, row b of new
    into cache row rows[b] at slots pos[b].. (cpu_prefix.cc), in place: XLA:CPU's own update-slice
    widens a bfloat16 cache to float32 and back, whole, at every write."""
    call = jax.ffi.ffi_call("jaxsmol_write_rows", jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, new, rows.astype(jnp.int32), pos.astype(jnp.int32), jnp.asarray(layer, jnp.int32))


def copy_row(cache: jax.Array, source: jax.Array, dest: jax.Array, n: jax.Array) -> jax.Array:
    """cache [L, R, K, S, H] with the first n slots of row `source` copied into row `dest`, in place
    where the cache is donated."""
    call = jax.ffi.ffi_call("jaxsmol_copy_row", jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, jnp.stack([source, dest, n]).astype(jnp.int32))


def reserve(shape: tuple[int, ...], dtype) -> jax.Array:
    """Zeros of `shape` whose whole pages are not touched (cpu_prefix.cc): memory only where written."""
    return jax.ffi.ffi_call("jaxsmol_reserve", jax.ShapeDtypeStruct(shape, dtype), has_side_effect=True)()
