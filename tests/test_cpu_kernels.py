"""The C++ CPU kernels (jaxsmol/kernels/cpu_kernels.py): the matmul (few-row and packed paths) and causal attention.

They must agree with XLA's dot and blocked attention to float32 rounding, give a row the same bits
whatever else shares its call (batch rows, or the chunk a query row arrives in), read nothing beyond
a row's position, and be switched on only where they apply (float32 or bfloat16 weights, one
device) and off cleanly where they cannot be built. (Cached == uncached with them on: tests/test_bitwise.py
and the prefix cache tests, whose engines have them on.)
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.kernels import cpu_kernels, formats
from jaxsmol.kernels.stacking import stack_layers, unstack_layers
from jaxsmol.model import forward as model
from jaxsmol.runtime import programs
from jaxsmol.model.kv import KVCache
from jaxsmol.cache.scheduler.many import generate



@pytest.fixture(autouse=True)
def kernels_built():
    """The kernels are what these tests test: without a C++ compiler that is a failed install step."""
    if not cpu_kernels.available():
        pytest.fail("the CPU kernels did not build: install a C++ compiler (Debian: apt-get install g++), "
                    "see the stderr line above", pytrace=False)




@pytest.mark.parametrize("M,K,N", [(1, 576, 1536), (1, 70, 160), (1, 64, 96), (3, 64, 192), (8, 33, 64),
                                   (16, 1536, 576), (17, 100, 96), (40, 64, 32), (31, 200, 64), (32, 576, 192),
                                   (45, 400, 96), (512, 576, 1536), (17, 576, 64), (19, 1536, 96), (18, 47, 64),
                                   (29, 40, 32), (1, 64, 608)])
def test_matmul_matches_a_float64_reference(M, K, N):
    rng = np.random.default_rng(M * K + N)
    x, w = rng.standard_normal((M, K), np.float32), rng.standard_normal((K, N), np.float32)
    got = np.asarray(cpu_kernels.matmul(jnp.asarray(x), jnp.asarray(cpu_kernels.pack(w))))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(K) * np.abs(want).max())


@pytest.mark.parametrize("M,K", [(2, 576), (8, 576), (16, 576), (21, 576), (32, 576), (64, 1536), (130, 400)])
def test_matmul_rows_do_not_depend_on_the_others(M, K):
    """A row alone gets exactly the bits it gets among M rows (one FMA chain over k in order), across
    the few-row path (M < 32) and the packed one, and a K that is no multiple of its 192-row blocks."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, K), np.float32))
    w = cpu_kernels.pack(jnp.asarray(rng.standard_normal((K, 1536), np.float32)))
    together = np.asarray(cpu_kernels.matmul(x, w))
    for r in (0, M // 2, M - 1):  # a lone row: two panels a pass (FewRows), an odd one alone
        np.testing.assert_array_equal(together[r], np.asarray(cpu_kernels.matmul(x[r:r + 1], w))[0])
        np.testing.assert_array_equal(together[r, :160], np.asarray(cpu_kernels.matmul(x[r:r + 1], w[:5]))[0])


@pytest.mark.parametrize("layout", ["float32", "q8_0 exact", "q4_1 int8"])
@pytest.mark.parametrize("M", [1, 8, 40])
def test_a_products_bits_do_not_depend_on_which_thread_takes_which_panels(layout, M):
    """The threads claim a product's panels in runs, one taking over another's share when it finishes
    first (cpu_kernels.h, ParallelForShares), so which thread computes a panel changes from call to
    call, most under load: a busy process beside the calls moves the panels between threads. 37 panels:
    shares of 18 and 19, runs of 8 with a short one. Every call gives the bits of the first, and every
    column is computed (the float64 reference)."""
    rng = np.random.default_rng(M)
    K, N = 576, 37 * 32
    x = jnp.asarray(rng.standard_normal((M, K), np.float32))
    w = rng.standard_normal((K, N), np.float32)
    if layout == "float32":
        panels, want = cpu_kernels.pack(w), np.asarray(x, np.float64) @ w
    else:
        fmt, dot = layout.split()
        exact = formats.quantize(w, fmt)
        dense = np.asarray(formats.dequantize(exact)).transpose(1, 0, 2).reshape(K, N)  # from [N / 32, K, 32]
        panels, want = formats.to_dot(exact, dot), np.asarray(x, np.float64) @ dense
    first = np.asarray(cpu_kernels.matmul(x, panels))
    assert np.abs(first - want).max() <= 0.02 * np.abs(want).max()  # int8 rounds x; the others agree closer
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(40):
            np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x, panels)), first)
    finally:
        busy.kill()
        busy.wait()


def _cache(rng, L=2, B=4, K=2, S=512, H=64):
    k = rng.standard_normal((L, B, K, S, H)).astype(np.float32)
    v = rng.standard_normal((L, B, K, S, H)).astype(np.float32)
    return k, v


@pytest.mark.parametrize("T,pos", [(1, [0, 17, 300, 511]), (1, 40), (64, [0, 64, 200, 448]), (128, 128)])
def test_attention_matches_xla_blocked_attention(T, pos):
    rng = np.random.default_rng(T)
    k, v = (jnp.asarray(a) for a in _cache(rng))
    q = jnp.asarray(rng.standard_normal((4, T, 2, 3, 64)).astype(np.float32) * 0.125)
    pos = jnp.asarray(pos, jnp.int32)
    got = cpu_kernels.attention(q, k, v, 1, pos)
    want = model.attention(q, k, v, jnp.int32(1), pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)


def test_attention_row_bits_do_not_depend_on_the_chunk():
    """A query row gets the same bits in a 128-row chunk, in a 64-row one, or in a short chunk that
    starts at it: rows are lanes that run the same operations in position order. (A decode step, one
    query per row, sums in another order: equal to rounding, checked against XLA above.)"""
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(a) for a in _cache(rng, B=1))
    q = jnp.asarray(rng.standard_normal((1, 128, 2, 3, 64)).astype(np.float32) * 0.125)
    whole = np.asarray(cpu_kernels.attention(q, k, v, 0, jnp.int32(64)))  # rows at positions 64..191
    second_half = np.asarray(cpu_kernels.attention(q[:, 64:], k, v, 0, jnp.int32(128)))
    np.testing.assert_array_equal(second_half, whole[:, 64:])
    for t in (0, 77, 120):
        short = np.asarray(cpu_kernels.attention(q[:, t:t + 5], k, v, 0, jnp.int32(64 + t)))
        np.testing.assert_array_equal(short, whole[:, t:t + 5])


def test_attention_reads_nothing_beyond_a_rows_position_and_rows_are_independent():
    rng = np.random.default_rng(1)
    k, v = _cache(rng)
    pos = np.asarray([5, 200, 64, 511], np.int32)
    q = jnp.asarray(rng.standard_normal((4, 1, 2, 3, 64)).astype(np.float32))
    clean = np.asarray(cpu_kernels.attention(q, jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(pos)))
    for b, p in enumerate(pos):  # stale slots past each row's position hold NaN
        k[:, b, :, p + 1:], v[:, b, :, p + 1:] = np.nan, np.nan
    dirty = np.asarray(cpu_kernels.attention(q, jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(pos)))
    np.testing.assert_array_equal(dirty, clean)
    for b in range(4):  # 511 is split into two key ranges (from 256 keys): by position, not by batch
        alone = cpu_kernels.attention(q[b:b + 1], jnp.asarray(k[:, b:b + 1]), jnp.asarray(v[:, b:b + 1]), 1,
                                      jnp.asarray(pos[b:b + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0], clean[b])


def test_forward_with_the_kernels_agrees_with_xla(tiny_cfg, params):
    """With the kernels on, a 64-row prefill chunk and a decode step agree with the XLA forward to
    float32 rounding, and the decode step's program calls both kernels."""
    on = dataclasses.replace(tiny_cfg, cpu_kernels=True)
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, tiny_cfg.vocab_size, (1, 64)), jnp.int32)
    step = jnp.asarray([[7]], jnp.int32)
    results = {}
    packed = cpu_kernels.pack_params(params)
    for name, cfg, p in (("xla", tiny_cfg, params), ("kernels", on, packed)):
        first, kv = programs.forward(p, prompt, jnp.int32(64), KVCache.zeros(cfg, 256), cfg)
        second, _ = programs.forward(p, step, jnp.int32(1), kv, cfg)
        results[name] = np.asarray(first), np.asarray(second)
    np.testing.assert_allclose(results["kernels"][0], results["xla"][0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(results["kernels"][1], results["xla"][1], rtol=0, atol=1e-4)
    hlo = programs.forward.lower(packed, step, jnp.int32(1), KVCache.zeros(on, 256), on).as_text()
    assert "jaxsmol_attention" in hlo and "jaxsmol_matmul" in hlo


@pytest.mark.parametrize("chunks", [[(1, 16), (299, 512)], [(16, 16), (284, 512)], [(20, 32), (100, 128), (180, 256)],
                                    [(64, 64), (236, 256)]])
def test_a_prompt_rows_bits_do_not_depend_on_its_chunks(tiny_cfg, params, chunks):
    """With the kernels, every row of a prefill chunk of >= 2 rows has the same bits (its logits and
    its keys and values) whatever the chunk's size or start: what lets the exact prefix cache use
    16- and 32-row chunks (jaxsmol/runtime/engine.py). (Without them, XLA's GEMM and row reductions differ
    below 64 rows.)"""
    cfg = dataclasses.replace(tiny_cfg, cpu_kernels=True)
    params = cpu_kernels.pack_params(params)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 300)

    def prefill(plan):
        kv, logits, done = KVCache.zeros(cfg, 1024), [], 0
        for n, T in plan:
            chunk = np.zeros((1, T), np.int32)
            chunk[0, :n] = ids[done:done + n]
            out, kv = programs.forward(params, jnp.asarray(chunk), jnp.int32(n), kv, cfg, all_logits=True)
            logits.append(np.asarray(out[0, :n]))
            done += n
        return np.concatenate(logits), np.asarray(kv.k)[..., :done, :], np.asarray(kv.v)[..., :done, :]

    for got, want in zip(prefill(chunks), prefill([(300, 512)])):
        np.testing.assert_array_equal(got, want)


def test_fused_products_change_no_bit(tiny_cfg, params):
    """q, k, v (and gate, up) as one packed product each give the bits of three (two) separate
    products: each output column is its own sum over k, whatever the columns beside it."""
    on = dataclasses.replace(tiny_cfg, cpu_kernels=True)
    layers = unstack_layers(params.layers)
    separate = params.replace(layers=stack_layers(
        lambda i: layers[i].replace(**{f: cpu_kernels.pack(getattr(layers[i], f)) for f in cpu_kernels.MATRICES}),
        len(layers)), unembed=cpu_kernels.pack(params.unembed))
    fused = cpu_kernels.pack_params(params)
    assert separate.layers.wqkv is None and fused.layers.wqkv is not None
    prompt = jnp.asarray(np.random.default_rng(6).integers(0, tiny_cfg.vocab_size, (3, 32)), jnp.int32)
    outs = [programs.forward(p, prompt, jnp.int32(32), KVCache.zeros(on, 64, batch=3), on, all_logits=True)
            for p in (separate, fused)]
    for a, b in zip(*(jax.tree.leaves(o) for o in outs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_packed_weights_round_trip_and_are_required(tiny_cfg, params):
    """pack/unpack are inverses; the loader packs under the kernels; a forward with the kernels on
    and unpacked params is an error naming the fix, not a silent fallback."""
    from jaxsmol.model.params import abstract_params

    w = np.arange(6 * 64, dtype=np.float32).reshape(6, 64)
    assert cpu_kernels.pack(w).shape == (2, 6, 32) and cpu_kernels.pack(w)[1, 2, 3] == w[2, 35]
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack(cpu_kernels.pack(jnp.asarray(w)))), w)
    with pytest.raises(ValueError, match="N % 32"):
        cpu_kernels.pack(w[:, :48])
    on = dataclasses.replace(tiny_cfg, cpu_kernels=True)
    packed = cpu_kernels.pack_params(params)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack(packed.layers.w_down[1])),
                                  np.asarray(params.layers.w_down[1]))
    assert jax.tree.map(lambda a: a.shape, abstract_params(on)) == jax.tree.map(lambda a: a.shape, packed)
    assert packed.embed.shape == params.embed.shape  # gathered by row: never packed
    unpacked = cpu_kernels.pack_params(packed, packed=False)  # the fused products split back too
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), unpacked, params))
    assert packed.layers.wq is None and packed.layers.wqkv.shape == (2, 4, 64, 32)  # stacked: [L, ...]
    with pytest.raises(ValueError, match="pack_params"):
        programs.forward(params, jnp.zeros((1, 16), jnp.int32), jnp.int32(16), KVCache.zeros(on, 256), on)
    assert not cpu_kernels.fits(dataclasses.replace(tiny_cfg, ffn_dim=144))  # 144 % 32: kernels off


def test_rms_norm_in_order_agrees_and_ignores_the_row_count():
    """Jitted, as the forward runs it (one program per row count, where XLA may fuse and retile the tree's
    ops: eagerly each op ran alone, compiled per shape, 13 s of the suite, and its bits are not the forward's)."""
    norm = jax.jit(model.rms_norm, static_argnums=(2, 3))
    rng = np.random.default_rng(4)
    # D = 64: XLA's own mean gives the rows of a 16- or 32-row call other bits than a 64-row call gives them
    # (measured, eager and jitted alike), so a fall-back to it fails here; at 576, the model's width, it did not
    for D in (64, 576):
        x = jnp.asarray(rng.standard_normal((64, D)).astype(np.float32))
        w = jnp.asarray(rng.standard_normal(D).astype(np.float32))
        together = np.asarray(norm(x, w, 1e-5, True))
        np.testing.assert_allclose(together, np.asarray(norm(x, w, 1e-5, False)), rtol=2e-6, atol=2e-6)
        for rows in (1, 2, 16, 32):
            np.testing.assert_array_equal(np.asarray(norm(x[:rows], w, 1e-5, True)), together[:rows], err_msg=D)


def test_the_kernels_use_this_cpus_vector_width():
    """16 floats with AVX-512, else 8: a vector wider than the registers is emulated, and the register
    tiles spill (a 16-lane build on an AVX2-only CPU ran the matmuls at 1/17 of XLA's speed)."""
    flags = " ".join(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    assert cpu_kernels.vector_lanes() == (16 if "avx512f" in flags else 8)


def test_engine_turns_the_kernels_on_only_where_they_apply(tiny_cfg, tiny_engine):
    """float32 or bfloat16 weights on one device: on (a mesh: off, asserted in tests/test_sharding.py);
    shapes that are not whole weight panels: off."""
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random

    assert tiny_engine.cfg.cpu_kernels
    assert Engine(tiny_cfg, init_random(tiny_cfg, dtype=jnp.bfloat16), None).cfg.cpu_kernels
    odd = dataclasses.replace(tiny_cfg, ffn_dim=144)
    assert not Engine(odd, init_random(odd), None).cfg.cpu_kernels


@pytest.mark.parametrize("M", [1, 3, 8, 16, 31, 32, 100])
def test_bfloat16_weights_give_the_bits_of_their_float32_values(M):
    """A bfloat16 weight is widened exactly as it loads, so its product has the bits of the same
    values stored float32, on the few-row and the many-row paths."""
    rng = np.random.default_rng(M)
    w = jnp.asarray(rng.standard_normal((576, 1536), dtype=np.float32)).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((M, 576), dtype=np.float32))
    half = jnp.asarray(cpu_kernels.pack(np.asarray(w)))
    assert half.dtype == jnp.bfloat16
    got = np.asarray(cpu_kernels.matmul(x, half))
    np.testing.assert_array_equal(got, np.asarray(cpu_kernels.matmul(x, cpu_kernels.pack(w.astype(jnp.float32)))))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=0, atol=1e-3)


def test_a_bfloat16_engine_keeps_its_matrices_narrow_and_computes_in_float32(tiny_cfg):
    """bfloat16 weights under the kernels: the matrices stay bfloat16 (half the bytes a decode step
    streams, as do the embedding and norms); activations and cache are float32; and the logits and tokens are
    those of a float32 engine whose weights hold the same (bfloat16-rounded) values, bit for bit."""
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random
    from jaxsmol.runtime.sampling import SamplingParams

    narrow = init_random(tiny_cfg, seed=3, dtype=jnp.bfloat16)
    e16 = Engine(tiny_cfg, narrow, None, ctx=512)
    e32 = Engine(tiny_cfg, jax.tree.map(lambda a: a.astype(jnp.float32), narrow), None, ctx=512)
    assert e16.cfg.cpu_kernels and e32.cfg.cpu_kernels
    assert {w.dtype for w in jax.tree.leaves(e16.params.layers) if w.ndim == 4} == {jnp.dtype(jnp.bfloat16)}
    assert e16.params.unembed.dtype == e16.params.embed.dtype == e16.params.layers.attn_norm.dtype == jnp.bfloat16
    assert e16.params.compute_dtype == jnp.float32 and e16.new_cache(64).k.dtype == jnp.float32
    assert e16.params.nbytes * 2 == e32.params.nbytes
    ids = [int(t) for t in np.random.default_rng(4).integers(3, tiny_cfg.vocab_size, 100)]
    np.testing.assert_array_equal(e16.logits_all(ids), e32.logits_all(ids))
    sp = SamplingParams(max_tokens=6)
    assert generate(e16, ids, sp).output_ids == generate(e32, ids, sp).output_ids


def test_kernels_off_without_a_compiler(tmp_path, tiny_model_dir):
    """No C++ compiler: one line on stderr says so, and generation runs on XLA's dot."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), JAXSMOL_HOME=str(tmp_path / "home"))
    code = ("from jaxsmol.runtime.engine import Engine\n"
            f"e = Engine.load({str(tiny_model_dir)!r}, progress=False)\n"
            "from jaxsmol.runtime.sampling import SamplingParams\n"
            "from jaxsmol.cache import generate\n"
            "g = generate(e, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "print('kernels', e.cfg.cpu_kernels, len(g.output_ids))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "kernels False 3" in done.stdout
    assert "CPU kernels are not available" in done.stderr and "no-such-compiler" in done.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_programs_compiled_while_loading_are_the_ones_a_request_runs(tiny_cfg, dtype, caplog):
    """compile_ahead.compile_lone_request builds a lone request's programs from shapes alone (`jaxsmol
    generate` runs it while the weights load); the request then compiles none of them itself (its
    prefill chunks, first token, decode step over the engine's arena), in either dtype (a bfloat16
    engine's cache is float32 under the kernels, as its shapes must say)."""
    import logging

    from jaxsmol.cache.scheduler.compile_ahead import compile_lone_request
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random
    from jaxsmol.runtime.sampling import SamplingParams

    cfg = cpu_kernels.configure(tiny_cfg, getattr(jnp, dtype))
    assert cfg.cpu_kernels
    # 32- and 8-row chunks, sample_first, decode_step
    assert compile_lone_request(cfg, dtype, cfg.max_position, 40, 4) == 4
    engine = Engine(cfg, init_random(cfg, seed=5, dtype=getattr(jnp, dtype)), None)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        generate(engine, list(range(3, 43)), SamplingParams(max_tokens=4))
    ours = ("prefill_rows", "sample_first", "decode_step")
    compiled = [r.getMessage()[:60] for r in caplog.records
                if r.getMessage().startswith(tuple(f"Compiling jit({name}" for name in ours))]
    assert compiled == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_load_prefix_kernel_writes_what_dynamic_update_slice_writes(dtype):
    """Engine.restore's copy into the (donated) cache: the prefix's slots as XLA's
    dynamic-update-slice writes them, every other slot as it was."""
    rng = np.random.default_rng(0)
    shape = (3, 1, 2, 512, 16)
    cache = jnp.asarray(rng.standard_normal(shape), dtype)
    k, v = (jnp.asarray(rng.standard_normal((3, 1, 2, 256, 16)), dtype) for _ in range(2))
    def fresh():  # load_prefix donates the cache
        return KVCache(k=jnp.array(cache, copy=True), v=cache * 2, pos=jnp.int32(0))

    want = programs.load_prefix(fresh(), k, v, jnp.int32(200))
    got = programs.load_prefix(fresh(), k, v, jnp.int32(200), kernel=True)
    assert int(got.pos) == 200
    for a, b in ((got.k, want.k), (got.v, want.v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
