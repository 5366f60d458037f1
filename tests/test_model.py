"""The pure forward pass (jaxsmol/model/forward.py, rope.py, kv.py) on the tiny config; Config.from_hf and the
real configurations' shapes are in tests/test_config.py.

The forward is jitted here without donation (`_fwd`), so a cache can be fed to several calls.
Most calls use one padded shape (T=1024 prefill, T=1 decode, capacity 1024) to keep compiles few.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.model.kv import KVCache
from jaxsmol.model.forward import ATTN_BLOCK, forward, rms_norm
from jaxsmol.model.params import init_random
from jaxsmol.model.rope import apply_rope, rope_tables
from jaxsmol.cache.scheduler.many import generate

_fwd = jax.jit(forward, static_argnames=("cfg", "all_logits"))
CAP = 1024  # cache capacity used throughout (4 attention blocks)


def _ids(n, seed=0, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


def _run(params, cfg, ids, kv=None, T=None, all_logits=False, batch=1):
    """Forward `ids` (a [n] or [B, n] array), padded with zeros to T rows, at kv.pos (fresh cache if None)."""
    ids = np.atleast_2d(np.asarray(ids, np.int32))
    B, n = ids.shape
    T = T or n
    tokens = np.zeros((B, T), np.int32)
    tokens[:, :n] = ids
    if kv is None:
        kv = KVCache.zeros(cfg, CAP, batch=B)
    return _fwd(params, jnp.asarray(tokens), jnp.int32(n), kv, cfg, all_logits=all_logits)


# ---- building blocks -----------------------------------------------------------------------------

def _np_rope(x, positions, theta):
    """HF Llama reference: q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1)."""
    H = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    freqs = np.outer(positions.astype(np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, H]
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_rope_matches_numpy_reference(theta):
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 2, 7, 255, 256, 1000, 2047])
    x = rng.standard_normal((2, len(positions), 3, 16)).astype(np.float32)  # [B, T, heads, H]
    sin, cos = rope_tables(jnp.asarray(positions, jnp.int32), 16, theta)
    assert sin.shape == cos.shape == (len(positions), 16)
    got = np.asarray(apply_rope(jnp.asarray(x), sin, cos))
    np.testing.assert_allclose(got, _np_rope(x.astype(np.float64), positions, theta), atol=2e-4, rtol=1e-4)
    # position 0 is the identity
    np.testing.assert_array_equal(got[:, 0], x[:, 0])


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 1, 16)).astype(np.float32)

    def score(m, n):
        sin, cos = rope_tables(jnp.array([m, n], jnp.int32), 16, 10000.0)
        qr = apply_rope(jnp.broadcast_to(q, (1, 2, 1, 16)), sin, cos)[0, 0, 0]
        kr = apply_rope(jnp.broadcast_to(k, (1, 2, 1, 16)), sin, cos)[0, 1, 0]
        return float(qr @ kr)

    assert score(10, 3) == pytest.approx(score(110, 103), abs=1e-4)
    assert score(10, 3) == pytest.approx(score(507, 500), abs=1e-4)


def test_rms_norm_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 3
    w = rng.standard_normal(64).astype(np.float32)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)), ref, rtol=1e-5, atol=1e-5)


# ---- forward shapes and masking ------------------------------------------------------------------

def test_forward_shapes(params, tiny_cfg):
    c = tiny_cfg
    kv0 = KVCache.zeros(c, CAP, batch=2)
    assert kv0.k.shape == (c.n_layers, 2, c.n_kv_heads, CAP, c.head_dim)  # [L, B, K, S, H]
    ids = np.stack([_ids(10, 0), _ids(10, 1)])
    logits, kv = _run(params, c, ids, kv0, T=64)
    assert logits.shape == (2, c.vocab_size) and logits.dtype == jnp.float32
    assert kv.k.shape == kv.v.shape == kv0.k.shape and int(kv.pos) == 10
    all_logits, kv2 = _run(params, c, ids, kv, T=64, all_logits=True)
    assert all_logits.shape == (2, 64, c.vocab_size)
    assert int(kv2.pos) == 20
    # the last-token logits are the all-logits row at length - 1
    last, _ = _run(params, c, ids, kv, T=64)
    np.testing.assert_allclose(np.asarray(last), np.asarray(all_logits[:, 9]), atol=1e-5)


def test_bfloat16_forward_keeps_its_dtype_and_tracks_float32(tiny_cfg):
    """bfloat16 weights: the layer carry stays bfloat16 (RoPE's float32 tables are cast, as in HF),
    the cache is bfloat16, and the logits stay close to the float32 model's."""
    c = tiny_cfg
    ids = np.asarray([_ids(10, 0)])
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        logits, kv = _run(init_random(c, seed=0, dtype=dtype), c, ids, KVCache.zeros(c, CAP, dtype=dtype), T=64)
        assert kv.k.dtype == dtype and logits.dtype == jnp.float32
        out[dtype] = np.asarray(logits)
    assert np.all(np.isfinite(out[jnp.bfloat16]))
    assert np.abs(out[jnp.bfloat16] - out[jnp.float32]).max() < 0.1 * np.abs(out[jnp.float32]).max() + 0.1


def test_causal_mask(params, tiny_cfg):
    a = _ids(100, 0)
    b = a.copy()
    b[60:] = (b[60:] + 1) % 256
    la, _ = _run(params, tiny_cfg, a, T=128, all_logits=True)
    lb, _ = _run(params, tiny_cfg, b, T=128, all_logits=True)
    la, lb = np.asarray(la[0]), np.asarray(lb[0])
    np.testing.assert_array_equal(la[:60], lb[:60])
    assert not np.allclose(la[60:100], lb[60:100])


def test_padding_rows_do_not_change_real_rows(params, tiny_cfg):
    ids = _ids(40, 3)
    tokens_a = np.zeros((1, 64), np.int32)
    tokens_b = _ids(64, 4)[None]  # different padding
    tokens_a[0, :40] = tokens_b[0, :40] = ids
    la, kva = _fwd(params, jnp.asarray(tokens_a), jnp.int32(40), KVCache.zeros(tiny_cfg, CAP), tiny_cfg,
                   all_logits=True)
    lb, kvb = _fwd(params, jnp.asarray(tokens_b), jnp.int32(40), KVCache.zeros(tiny_cfg, CAP), tiny_cfg,
                   all_logits=True)
    np.testing.assert_array_equal(np.asarray(la[0, :40]), np.asarray(lb[0, :40]))
    np.testing.assert_array_equal(np.asarray(kva.k[:, :, :, :40]), np.asarray(kvb.k[:, :, :, :40]))
    np.testing.assert_array_equal(np.asarray(kva.v[:, :, :, :40]), np.asarray(kvb.v[:, :, :, :40]))
    assert int(kva.pos) == int(kvb.pos) == 40
    # last-token logits ignore the padding too
    la1, _ = _fwd(params, jnp.asarray(tokens_a), jnp.int32(40), KVCache.zeros(tiny_cfg, CAP), tiny_cfg)
    lb1, _ = _fwd(params, jnp.asarray(tokens_b), jnp.int32(40), KVCache.zeros(tiny_cfg, CAP), tiny_cfg)
    np.testing.assert_array_equal(np.asarray(la1), np.asarray(lb1))


def _with_slots_from(kv: KVCache, start: int, value_fn) -> KVCache:
    k, v = np.array(kv.k), np.array(kv.v)
    k[:, :, start:] = value_fn(k[:, :, start:].shape, 0)
    v[:, :, start:] = value_fn(v[:, :, start:].shape, 1)
    return kv.replace(k=jnp.asarray(k), v=jnp.asarray(v))


def _garbage(shape, seed):
    return np.random.default_rng(seed).choice([-1e30, 1e30, 3e29], size=shape).astype(np.float32)


@pytest.mark.parametrize("n", [5, 300])
def test_stale_slots_beyond_pos_never_influence_results(params, tiny_cfg, n):
    ids = _ids(n + 40, 5)
    _, kv = _run(params, tiny_cfg, ids[:n], T=512)
    clean = _with_slots_from(kv, n, lambda s, _: np.zeros(s, np.float32))
    dirty = _with_slots_from(kv, n, _garbage)
    # a decode step, a padded chunk after it, and its all-logits rows: bit-identical
    l1, c1 = _run(params, tiny_cfg, ids[n:n + 1], clean)
    l2, c2 = _run(params, tiny_cfg, ids[n:n + 1], dirty)
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    assert np.isfinite(np.asarray(l2)).all()
    l1, _ = _run(params, tiny_cfg, ids[n + 1:], c1, T=64, all_logits=True)
    l2, _ = _run(params, tiny_cfg, ids[n + 1:], c2, T=64, all_logits=True)
    np.testing.assert_array_equal(np.asarray(l1[0, :39]), np.asarray(l2[0, :39]))


def test_blocks_beyond_the_last_in_use_are_never_read(params, tiny_cfg):
    """NaN in every slot of blocks past the one holding the last query: were any such block read,
    0 * NaN in the value sum would poison the logits. This is the traced trip count at work."""
    n = 100
    ids = _ids(n + 8, 6)
    _, kv = _run(params, tiny_cfg, ids[:n], T=128)
    clean = _with_slots_from(kv, ATTN_BLOCK, lambda s, _: np.zeros(s, np.float32))
    nan = _with_slots_from(kv, ATTN_BLOCK, lambda s, _: np.full(s, np.nan, np.float32))
    for t in ids[n:]:
        l1, clean = _run(params, tiny_cfg, [t], clean)
        l2, nan = _run(params, tiny_cfg, [t], nan)
        assert np.isfinite(np.asarray(l2)).all()
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_attention_loop_has_a_traced_trip_count(params, tiny_cfg):
    jaxpr = jax.make_jaxpr(functools.partial(forward, cfg=tiny_cfg))(
        params, jnp.zeros((1, 1), jnp.int32), jnp.int32(1), KVCache.zeros(tiny_cfg, 4 * ATTN_BLOCK))
    assert "while" in str(jaxpr)


@pytest.mark.parametrize("n", [1, 200, 253, 256, 257, 511, 700])
def test_prefill_then_decode_equals_one_forward(params, tiny_cfg, n):
    """n prompt tokens (one padded chunk) then k decode steps == one forward over n + k tokens.
    The n cover prompts that end before, at and after the 256-slot block boundaries."""
    k = 4
    ids = _ids(n + k, n)
    ref, _ = _run(params, tiny_cfg, ids, T=CAP, all_logits=True)
    ref = np.asarray(ref[0])
    logits, kv = _run(params, tiny_cfg, ids[:n], T=CAP)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[n - 1], atol=1e-5)
    for j in range(k):
        logits, kv = _run(params, tiny_cfg, ids[n + j:n + j + 1], kv)
        np.testing.assert_allclose(np.asarray(logits[0]), ref[n + j], atol=1e-5, err_msg=f"decode step {j}")
    assert int(kv.pos) == n + k


@pytest.mark.parametrize("n", [600, 1000])
def test_chunked_prefill_equals_one_shot(tiny_engine, n):
    from jaxsmol.runtime.chunks import chunk_plan

    assert len(chunk_plan(n)) == 2
    ids = _ids(n, 7).tolist()
    kv = tiny_engine.new_cache(tiny_engine.slots_needed(0, n, 0))
    logits, kv = tiny_engine.prefill(ids, kv)
    assert int(kv.pos) == n
    ref_logits, ref_kv = _run(tiny_engine.params, tiny_engine.cfg, ids, T=CAP, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref_logits[0, n - 1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kv.k[:, :, :, :n]), np.asarray(ref_kv.k[:, :, :, :n]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kv.v[:, :, :, :n]), np.asarray(ref_kv.v[:, :, :, :n]), atol=1e-5)
    np.testing.assert_allclose(tiny_engine.logits_all(ids), np.asarray(ref_logits[0, :n]), atol=1e-5)


def test_batch_rows_are_independent(params, tiny_cfg):
    a, b, c = _ids(50, 10), _ids(50, 11), _ids(50, 12)
    lab, kab = _run(params, tiny_cfg, np.stack([a, b]), T=64, all_logits=True)
    lac, _ = _run(params, tiny_cfg, np.stack([a, c]), T=64, all_logits=True)
    la, ka = _run(params, tiny_cfg, a, T=64, all_logits=True)
    lb, _ = _run(params, tiny_cfg, b, T=64, all_logits=True)
    np.testing.assert_array_equal(np.asarray(lab[0]), np.asarray(lac[0]))  # row 0 ignores row 1
    np.testing.assert_allclose(np.asarray(lab[0]), np.asarray(la[0]), atol=1e-5)  # and equals B=1
    np.testing.assert_allclose(np.asarray(lab[1]), np.asarray(lb[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kab.k[:, :1, :, :50]), np.asarray(ka.k[:, :, :, :50]), atol=1e-5)
    # decode continues both rows independently
    d2, _ = _run(params, tiny_cfg, np.array([[3], [4]]), kab)
    d1, _ = _run(params, tiny_cfg, np.array([[3]]), ka)
    np.testing.assert_allclose(np.asarray(d2[0]), np.asarray(d1[0]), atol=1e-5)


# ---- bfloat16 against float32 -----------------------------------------------------------------------

def _logprobs(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


# Why these bounds: bfloat16 keeps 8 significant bits, so every weight (and, on XLA's ops, every
# activation and cached key or value) fed to a product is off by up to 2^-9 relative. The logits come
# out of 2 (tiny) or 30 (real) layers of such roundings; a log-prob moves by at most twice its logits'
# largest move (the log-sum-exp moves by at most that much). Measured on XLA's ops: tiny 0.05 nats at
# most over the whole vocabulary; real (SmolLM2-135M) 0.29 nats at most among tokens the float32
# model gives log-prob > -10 (0.45 over the whole vocabulary, in the far tail) on three prompts. With
# the kernels (only the weights rounded): real 0.10 nats (0.13 over the whole vocabulary). A dtype bug
# (float32 state rounded through bfloat16 twice, RoPE or softmax in bfloat16, a cache of the wrong
# dtype) moves them by whole nats. The bounds leave about 4x (tiny) and 2.5x (real) the measured
# moves of XLA's ops for other prompts.
TINY_BF16_NATS = 0.2
REAL_BF16_NATS = 0.75  # among tokens with float32 log-prob > -10


@pytest.mark.parametrize("kernels", [True, False])
def test_bfloat16_runs_end_to_end_close_to_float32(tiny_cfg, tiny_engine, tmp_path, monkeypatch, kernels):
    """On the CPU kernels (only the matrices bfloat16; a float32 cache) and on XLA's ops (as with a
    mesh, or without a C++ compiler: products and cache bfloat16)."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.kernels import cpu_kernels
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.runtime.sampling import SamplingParams

    if not kernels:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    e16 = Engine(tiny_cfg, init_random(tiny_cfg, dtype=jnp.bfloat16), None, ctx=1024)
    e16._fingerprint = f"tiny-bf16-{kernels}"
    cache_dtype = jnp.float32 if kernels else jnp.bfloat16
    ids = [int(t) for t in _ids(100, seed=3, vocab=253) + 3]
    assert e16.cfg.cpu_kernels == kernels and e16.new_cache(128).k.dtype == cache_dtype
    a, b = tiny_engine.logits_all(ids), e16.logits_all(ids)
    assert b.dtype == np.float32
    assert np.abs(_logprobs(a) - _logprobs(b)).max() <= TINY_BF16_NATS
    sp = SamplingParams(max_tokens=8)
    cold = generate(e16, ids, sp)
    assert cold.output_ids == generate(tiny_engine, ids, sp).output_ids
    # the prefix cache holds segments of the cache's dtype, and a warm run has the bits of the cold one
    cache = PrefixCache(e16)
    generate(cache, ids, sp)
    warm = generate(cache, ids + cold.output_ids[:3] + [7, 8], sp)
    report = warm.report
    ref = generate(e16, ids + cold.output_ids[:3] + [7, 8], sp)
    assert report.reused >= 100 and warm.output_ids == ref.output_ids
    assert np.array_equal(warm.prompt_logits, ref.prompt_logits)
    seg = cache.snapshot_of(ids)
    assert seg.k.dtype == cache_dtype and seg.logits[100].dtype == np.float32
    # a snapshot file passes the engine's dtype check and restores exactly
    from jaxsmol.cache.store.disk import load_prompt_cache, save_prompt_cache

    save_prompt_cache(cache, tmp_path / "bf16.safetensors", ids)
    loaded = PrefixCache(e16)
    report = load_prompt_cache(loaded, tmp_path / "bf16.safetensors", ids)
    assert report.refused is None and report.loaded == 100
    again = generate(loaded, ids, sp)
    r = again.report
    assert r.exact_hit and again.output_ids == cold.output_ids


@pytest.mark.real
def test_bfloat16_real_model_parity(model_dir, real_engine):
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.runtime.sampling import SamplingParams

    e16 = Engine.load(model_dir, ctx=2048, dtype="bfloat16", progress=False)
    tok = real_engine.tokenizer
    for text in ["The capital of France is", "Once upon a time, there was a little girl who"]:
        ids = tok.encode(text)
        a, b = _logprobs(real_engine.logits_all(ids)), _logprobs(e16.logits_all(ids))
        plausible = a > -10
        assert np.abs(a - b)[plausible].max() <= REAL_BF16_NATS, text
        margin = np.sort(a, axis=-1)[:, -1] - np.sort(a, axis=-1)[:, -2]
        clear = margin > 2 * REAL_BF16_NATS  # a top pick that no move within the bound can change
        assert (a.argmax(-1) == b.argmax(-1))[clear].all(), text
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    sp = SamplingParams(max_tokens=12)
    g32, g16 = generate(real_engine, tok.encode(chat), sp), generate(e16, tok.encode(chat), sp)
    assert "Paris" in g16.text and g16.output_ids == g32.output_ids
