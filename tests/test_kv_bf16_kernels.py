"""The CPU kernels over a bfloat16 KV cache (`--kv-dtype bfloat16`; jaxsmol/kernels/cpu_attention.cc,
cpu_prefix.cc).

The attention kernel reads a bfloat16 cache in place and widens each key and value exactly as it loads
(a bfloat16 is a float32's top 16 bits); q, scores, softmax, sums and output stay float32. So on a
bfloat16 cache it must give exactly the bits it gives on a float32 cache holding the same
(bfloat16-rounded) values: prompt chunks of every tile path, decode steps with per-row positions, every
head size it handles. Restore's copy of a snapshot prefix (load_prefix) writes a bfloat16 prefix as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.kernels import cpu_copies, cpu_kernels
from jaxsmol.model import forward as model
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime import programs


@pytest.fixture(autouse=True)
def kernels_built():
    """The kernels are what these tests test: without a C++ compiler that is a failed install step."""
    if not cpu_kernels.available():
        pytest.fail("the CPU kernels did not build: install a C++ compiler (Debian: apt-get install g++), "
                    "see the stderr line above", pytrace=False)


def _caches(rng, L=2, B=4, K=2, S=512, H=64):
    """(k16, v16, k32, v32): a random bfloat16 cache [L, B, K, S, H] and the float32 cache of its values."""
    k16, v16 = (jnp.asarray(rng.standard_normal((L, B, K, S, H)).astype(np.float32)).astype(jnp.bfloat16)
                for _ in range(2))
    return k16, v16, k16.astype(jnp.float32), v16.astype(jnp.float32)


def _queries(rng, B, T, K=2, G=3, H=64):
    return jnp.asarray(rng.standard_normal((B, T, K, G, H)).astype(np.float32) * H ** -0.5)


def _both(q, k16, v16, k32, v32, layer, pos):
    """The kernel's output over the bfloat16 cache and over the float32 one."""
    pos = jnp.asarray(pos, jnp.int32)
    return (np.asarray(cpu_kernels.attention(q, k16, v16, layer, pos)),
            np.asarray(cpu_kernels.attention(q, k32, v32, layer, pos)))


@pytest.mark.parametrize("T", [1, 2, 16, 64])
@pytest.mark.parametrize("pos", [0, 37, 200, 448])
def test_a_prompt_chunk_over_a_bfloat16_cache_has_the_float32_caches_bits(T, pos):
    """One sequence's chunk of T rows from position pos (T = 1: a decode step of one row): the bits of
    the float32 cache's, through the short-chunk tile (T <= 16, the heads together), the 16- and
    32-row tiles, and the decode path split in two key ranges (from 256 keys)."""
    rng = np.random.default_rng(T * 1000 + pos)
    k16, v16, k32, v32 = _caches(rng, B=1)
    got, want = _both(_queries(rng, 1, T), k16, v16, k32, v32, 1, pos)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("T,pos", [(3, [0, 5, 100, 400]), (16, [0, 64, 200, 496]), (64, [0, 64, 200, 448]),
                                   (128, 128)])
def test_batched_prompt_chunks_over_a_bfloat16_cache_have_the_float32_caches_bits(T, pos):
    rng = np.random.default_rng(T)
    k16, v16, k32, v32 = _caches(rng)
    got, want = _both(_queries(rng, 4, T), k16, v16, k32, v32, 0, pos)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("pos", [[0, 17, 300, 511], [255, 256, 257, 40], [511, 511, 0, 1]])
def test_a_decode_step_over_a_bfloat16_cache_has_the_float32_caches_bits(pos):
    """Batched decode rows, each at its own position (one range of keys, or two from 256 keys on)."""
    rng = np.random.default_rng(sum(pos))
    k16, v16, k32, v32 = _caches(rng)
    q = _queries(rng, 4, 1)
    for layer in (0, 1):
        got, want = _both(q, k16, v16, k32, v32, layer, pos)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("H", cpu_kernels.HEAD_DIMS)
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5])
def test_every_head_size_and_group_over_a_bfloat16_cache_has_the_float32_caches_bits(H, G):
    """Each head size is its own instance of the kernel (vectors per head), and each group size its
    own split of the heads (3 at once in decode; the short chunk's tile holds G x T lanes)."""
    rng = np.random.default_rng(H * 10 + G)
    k16, v16, k32, v32 = _caches(rng, L=1, B=2, K=2, S=320, H=H)
    for T, pos in ((1, [3, 300]), (5, [0, 250]), (16, [100, 10]), (40, [0, 280])):
        q = _queries(rng, 2, T, G=G, H=H)
        got, want = _both(q, k16, v16, k32, v32, 0, pos)
        np.testing.assert_array_equal(got, want, err_msg=f"T={T} pos={pos}")


def test_the_bfloat16_kernel_agrees_with_xla_and_reads_nothing_beyond_a_rows_position():
    """Over a bfloat16 cache the kernel agrees with XLA's blocked attention on the float32 values to
    float32 rounding; NaN in the slots past each row's position changes no bit; each decode row gets
    the bits it gets alone."""
    rng = np.random.default_rng(7)
    k16, v16, k32, v32 = _caches(rng)
    for T in (1, 16):
        pos = np.asarray([5, 200, 64, 512 - T], np.int32)  # the last row's chunk ends at the last slot
        q = _queries(rng, 4, T)
        clean = np.asarray(cpu_kernels.attention(q, k16, v16, 1, jnp.asarray(pos)))
        want = np.asarray(model.attention(q, k32, v32, jnp.int32(1), jnp.asarray(pos)))
        np.testing.assert_allclose(clean, want, rtol=0, atol=2e-6)
        k, v = np.asarray(k16).copy(), np.asarray(v16).copy()  # ml_dtypes bfloat16
        for b, p in enumerate(pos):
            k[:, b, :, p + T:], v[:, b, :, p + T:] = np.nan, np.nan
        dirty = np.asarray(cpu_kernels.attention(q, jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(pos)))
        np.testing.assert_array_equal(dirty, clean)
    q, pos = _queries(rng, 4, 1), np.asarray([5, 200, 64, 511], np.int32)
    together = np.asarray(cpu_kernels.attention(q, k16, v16, 1, jnp.asarray(pos)))
    for b in range(4):
        alone = cpu_kernels.attention(q[b:b + 1], k16[:, b:b + 1], v16[:, b:b + 1], 1, jnp.asarray(pos[b:b + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0], together[b])


def test_a_bfloat16_cache_goes_to_its_own_kernel():
    """attention_applies/attention_kernel_for take a float32 or bfloat16 cache (q float32), and
    attention() calls the bfloat16 target for a bfloat16 cache, the float32 one otherwise."""
    q = jax.ShapeDtypeStruct((1, 1, 2, 3, 64), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = jax.ShapeDtypeStruct((2, 1, 2, 256, 64), dtype)
        assert cpu_kernels.attention_kernel_for(dtype, 64) and cpu_kernels.attention_applies(q, cache)
        text = jax.jit(cpu_kernels.attention, static_argnums=3).lower(q, cache, cache, 1, jnp.int32(0)).as_text()
        assert ("jaxsmol_attention_bf16" in text) == (dtype == jnp.bfloat16) and "jaxsmol_attention" in text
    assert not cpu_kernels.attention_kernel_for(jnp.float16, 64)
    assert not cpu_kernels.attention_kernel_for(jnp.bfloat16, 48)
    q16 = jax.ShapeDtypeStruct((1, 1, 2, 3, 64), jnp.bfloat16)
    assert not cpu_kernels.attention_applies(q16, jax.ShapeDtypeStruct((2, 1, 2, 256, 64), jnp.bfloat16))


@pytest.mark.parametrize("P,shape", [(1, (3, 1, 2, 512, 16)), (200, (3, 1, 2, 512, 16)), (256, (2, 2, 3, 256, 64)),
                                     (64, (30, 1, 3, 1024, 64))])
def test_load_prefix_writes_a_bfloat16_prefix_exactly(P, shape):
    """Restore's copy into a bfloat16 cache (the kernel copies bytes, any dtype): slots 0..P-1 hold
    the prefix's bits, every other slot is as it was, directly and through programs.load_prefix."""
    rng = np.random.default_rng(P)
    L, B, K, S, H = shape
    cache = np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    prefix = np.asarray(jnp.asarray(rng.standard_normal((L, B, K, P, H)), jnp.bfloat16))
    want = cache.copy()
    want[:, :, :, :P] = prefix
    load = jax.jit(cpu_copies.load_prefix, donate_argnums=0)
    got = np.asarray(load(jnp.array(cache, copy=True), jnp.asarray(prefix)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    kv = KVCache(k=jnp.array(cache, copy=True), v=jnp.asarray(cache[::-1].copy()), pos=jnp.int32(0))
    out = programs.load_prefix(kv, jnp.asarray(prefix), jnp.asarray(prefix[::-1].copy()), jnp.int32(P), kernel=True)
    assert int(out.pos) == P and out.k.dtype == out.v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out.k).view(np.uint16), want.view(np.uint16))
    want_v = cache[::-1].copy()
    want_v[:, :, :, :P] = prefix[::-1]
    np.testing.assert_array_equal(np.asarray(out.v).view(np.uint16), want_v.view(np.uint16))


def test_load_prefix_refuses_a_prefix_of_another_dtype():
    cache = jnp.zeros((2, 1, 2, 64, 16), jnp.bfloat16)
    with pytest.raises(Exception, match="of its dtype"):
        jax.block_until_ready(cpu_copies.load_prefix(cache, jnp.ones((2, 1, 2, 8, 16), jnp.float32)))


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 17)])
def test_write_rows_writes_a_chunk_into_one_layer_exactly(B, T):
    """The forward's cache write on a bfloat16 cache with the kernels (XLA:CPU widens its own update-slice
    to float32, the whole cache at every layer): row b of the chunk at cache row rows[b], slots pos[b]..,
    layer `layer`; every other slot as it was."""
    rng = np.random.default_rng(B * 100 + T)
    L, R, K, S, H = 3, 5, 2, 64, 16
    cache = np.asarray(jnp.asarray(rng.standard_normal((L, R, K, S, H)), jnp.bfloat16))
    new = np.asarray(jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16))
    rows, pos, layer = rng.permutation(R)[:B].astype(np.int32), rng.integers(0, S - T, B).astype(np.int32), 1
    want = cache.copy()
    for b in range(B):
        want[layer, rows[b], :, pos[b]:pos[b] + T] = new[b].transpose(1, 0, 2)
    write = jax.jit(cpu_copies.write_rows, donate_argnums=0)
    got = np.asarray(write(jnp.array(cache, copy=True), jnp.asarray(new), jnp.int32(layer), jnp.asarray(pos),
                           jnp.asarray(rows)))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    with pytest.raises(Exception, match="outside the cache"):
        jax.block_until_ready(write(jnp.array(cache, copy=True), jnp.asarray(new), jnp.int32(layer),
                                    jnp.full(B, S - T + 1, jnp.int32), jnp.asarray(rows)))


@pytest.mark.parametrize("per_row", [True, False])
def test_the_forwards_bfloat16_write_is_xlas_update_slice(per_row):
    """The forward's write (model._write) with the kernels (write_rows) and without (XLA's update-slice):
    the same cache bits, per-row positions and rows (the arena) or one position (a lone sequence)."""
    rng = np.random.default_rng(7)
    cache = jnp.asarray(rng.standard_normal((3, 4, 2, 64, 16)), jnp.bfloat16)
    B, T = (3, 2) if per_row else (4, 5)
    new = jnp.asarray(rng.standard_normal((B, T, 2, 16)), jnp.bfloat16)
    pos, rows = (jnp.asarray([5, 0, 40], jnp.int32), jnp.asarray([3, 1, 0], jnp.int32)) if per_row else (
        jnp.int32(9), None)
    got = [jax.jit(lambda c, n, p, r, on=on: model._write(c, n, jnp.int32(2), p, r, kernels=on))(cache, new, pos, rows)
           for on in (True, False)]
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), np.asarray(got[1]).view(np.uint16))
    assert not np.array_equal(np.asarray(got[0]).view(np.uint16), np.asarray(cache).view(np.uint16))
