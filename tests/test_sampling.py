"""The sampler (jaxsmol/runtime/sampling.py): greedy, temperature, top-k and top-p, each row on its own, and
SamplingParams' checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from draws import draws
from jaxsmol.cache.scheduler.many import generate


# ---- sample_rows(): the traced sampler itself -----------------------------------------------------

def _draws(logits, n, temperature=1.0, top_k=0, top_p=1.0):
    """n samples from one row of logits, each with its own seed."""
    return draws(logits, n, temperature, top_k, top_p)[:, 0]


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    for top_k, top_p in [(0, 1.0), (5, 0.5)]:  # filters do not matter at temperature 0
        # 125 draws of the 4 rows, every one the argmax: the 500-row program of the tests below, compiled once
        np.testing.assert_array_equal(draws(logits, 125, 0.0, top_k, top_p), np.tile(logits.argmax(-1), (125, 1)))


def test_temperature_below_the_minimum_is_greedy(tiny_engine):
    """logits / 2e-38 overflow to inf: such a temperature is greedy, as vLLM does below 1e-5."""
    from jaxsmol.runtime.sampling import MIN_TEMPERATURE

    logits = (np.random.default_rng(2).standard_normal((4, 256)) * 10).astype(np.float32)
    for t in (2e-38, 1e-30, 1e-6, MIN_TEMPERATURE / 2):
        got = _draws(logits[0], 500, temperature=t)  # 500: the other tests' shape, one program
        assert (got == logits[0].argmax()).all(), t
    prompt = [1, 17, 42, 99, 7, 200, 13, 5, 64, 128]
    greedy = generate(tiny_engine, prompt, SamplingParams(max_tokens=8)).output_ids
    assert generate(tiny_engine, prompt, SamplingParams(temperature=2e-38, seed=3, max_tokens=8)).output_ids == greedy
    # just above the minimum it samples, and the scaled logits stay finite: still the clear argmax here
    assert (_draws(logits[0], 500, temperature=2 * MIN_TEMPERATURE) == logits[0].argmax()).all()


def test_sampling_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    freq = np.bincount(_draws(logits, 4000), minlength=4) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # temperature 0.5 squares and renormalizes the probabilities
    p2 = probs ** 2 / (probs ** 2).sum()
    freq = np.bincount(_draws(logits, 4000, temperature=0.5), minlength=4) / 4000
    np.testing.assert_allclose(freq, p2, atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    assert set(_draws(logits, 500, top_k=2)) == {0, 1}
    assert set(_draws(logits, 500, top_k=1)) == {0}
    assert set(_draws(logits, 500, top_p=0.75)) == {0, 1}  # smallest prefix with mass >= 0.75
    assert set(_draws(logits, 500, top_p=0.85)) == {0, 1, 2}
    assert set(_draws(logits, 500, top_p=1e-6)) == {0}
    # a top_p that float32 rounds to 0 still keeps the most likely id (it kept none, and id 0 was drawn
    # whatever the logits: the API fuzz found a grammar's mask broken that way)
    assert set(_draws(logits[::-1].copy(), 500, top_p=5e-324)) == {3}  # 500: the others' shape, compiled once
    assert set(_draws(logits, 500, top_k=3, top_p=0.75)) == {0, 1}
    big = np.random.default_rng(1).standard_normal(256).astype(np.float32) * 3
    assert set(_draws(big, 500, top_k=5)) <= set(np.argsort(-big)[:5])


def _nucleus_reference(logits, top_k, top_p):
    """The support top-k / top-p leave, by sorting (numpy, float64): the ids to keep."""
    order = np.argsort(-logits, kind="stable")
    keep = np.ones(logits.shape, bool)
    if top_k:
        keep &= logits >= logits[order[top_k - 1]]
    if top_p < 1:
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        mass_above = np.array([probs[logits > x].sum() for x in logits])
        keep &= mass_above < top_p
    return keep


def test_top_k_top_p_without_a_sort_match_a_sorted_reference():
    """Each row keeps exactly the ids a sort keeps, away from float ties at the edge, whether its
    thresholds lie among its CANDIDATES largest logits or take the bisection over the whole vocabulary;
    the rows are filtered together, each way taken by some of them."""
    from jaxsmol.runtime.sampling import CANDIDATES, _top_k_top_p

    rng = np.random.default_rng(7)
    V = 4 * CANDIDATES
    logits = np.stack([rng.standard_normal(V) * rng.choice([0.5, 2, 6]) for _ in range(40)]).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 40, CANDIDATES, CANDIDATES + 1, V], len(logits)).astype(np.int32)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], len(logits)).astype(np.float32)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    got = np.asarray(jax.jit(_top_k_top_p)((jnp.asarray(weights), jnp.asarray(logits), jnp.asarray(top_k),
                                            jnp.asarray(top_p))))  # jitted, as sample_rows runs it
    kept = []
    for i in range(len(logits)):
        want = _nucleus_reference(logits[i].astype(np.float64), int(top_k[i]), float(top_p[i]))
        np.testing.assert_array_equal(got[i] > 0, want, err_msg=f"row {i}: top_k={top_k[i]} top_p={top_p[i]}")
        np.testing.assert_array_equal(got[i][want], weights[i][want])
        kept.append(int(want.sum()))
    kept = np.array(kept)
    assert ((top_p < 1) & (top_k == 0) & (kept > CANDIDATES)).any()  # a nucleus past the candidates
    assert ((top_p < 1) & (top_k == 0) & (kept < CANDIDATES)).any()  # one inside them
    assert (top_k > CANDIDATES).any() and ((top_k > 0) & (top_k <= CANDIDATES)).any()


def test_the_two_level_draw_matches_an_inverse_cdf_and_never_picks_a_zero_weight():
    """_draw picks the first id whose running weight reaches (1 - u) x the total, as a float64 inverse
    CDF does away from rounding at a boundary, over vocabularies shorter than a block, not a multiple
    of it and many blocks long; ids of zero weight (masked, filtered) are never drawn, u near 0 (the
    point at the very end of the CDF, where the blocks' rounding may leave it past the last id)
    included."""
    from jaxsmol.runtime.sampling import DRAW_BLOCK
    from jaxsmol.runtime.sampling import _draw as draw

    # jitted, as sample_rows runs it (eagerly each of its ops, lax.cond's branches with their loops
    # included, was compiled alone for every shape: 15 s alone on 2 cores)
    _draw = jax.jit(draw)
    rng = np.random.default_rng(11)
    for V in (7, DRAW_BLOCK + 3, 24 * DRAW_BLOCK):
        logits = (rng.standard_normal((16, V)) * rng.choice([0.5, 3.0], (16, 1))).astype(np.float32)
        logits[rng.random((16, V)) < 0.3] = -1e30  # ids of zero weight, as a grammar's mask leaves them
        logits[:, 0] = 0.0  # every row keeps one id at least
        u = np.concatenate([rng.random(12), [0.0, 1e-9, 1 - 1e-7, 0.5]]).astype(np.float32)
        got = np.asarray(_draw(jnp.asarray(logits), jnp.zeros(16, jnp.int32), jnp.ones(16), jnp.asarray(u)))
        weights = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
        assert (weights[np.arange(16), got] > 0).all(), V
        cdf = np.cumsum(weights, axis=-1)
        point = (1 - u.astype(np.float64)) * cdf[:, -1]
        want = (cdf < point[:, None]).sum(-1)
        below = np.where(want > 0, cdf[np.arange(16), np.maximum(want - 1, 0)], 0.0)
        tol = 1e-5 * cdf[:, -1]  # the point this far from its interval's ends: float32 rounding (~1e-6) cannot move it
        clear = (point - below > tol) & (cdf[np.arange(16), np.minimum(want, V - 1)] - point > tol)
        np.testing.assert_array_equal(got[clear], want[clear], err_msg=f"V={V}")
        assert clear.sum() >= 12
    # the point at the total, where the block's running sum (1 + 4e-8 three times: 1 in float32) falls
    # short of its pairwise sum (1 + 8e-8 rounds up): the last id of positive weight, not one past it
    weights = np.array([1, 4e-8, 4e-8, 4e-8, 0, 0, 0])
    logits = np.where(weights > 0, np.log(np.maximum(weights, 1e-300)), -1e30).astype(np.float32)[None]
    assert int(_draw(jnp.asarray(logits), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1))[0]) == 3


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    """sample_rows: row i's token depends on its own logits, settings and seed only, at any width."""
    from jaxsmol.runtime.sampling import sample_rows

    rng = np.random.default_rng(3)
    W, V = 8, 300
    logits = (rng.standard_normal((W, V)) * 3).astype(np.float32)
    rows = dict(temperature=np.float32(rng.choice([0.0, 0.7, 1.3], W)), top_k=np.int32(rng.choice([0, 5, 50], W)),
                top_p=np.float32(rng.choice([1.0, 0.8], W)), seed_lo=np.uint32(rng.integers(0, 2**32, W)),
                seed_hi=np.uint32(rng.integers(0, 2**31, W)), step=np.int32(rng.integers(0, 99, W)),
                allowed=np.full((W, (V + 31) // 32), -1, np.int32))
    draw = jax.jit(sample_rows)
    together = np.asarray(draw(jnp.asarray(logits), **{k: jnp.asarray(v) for k, v in rows.items()}))
    for i in range(W):
        alone = draw(jnp.asarray(logits[i:i + 1]), **{k: jnp.asarray(v[i:i + 1]) for k, v in rows.items()})
        assert int(alone[0]) == together[i], i


def test_sampling_params_validation():
    for bad, word in [(dict(max_tokens=-1), "max_tokens"), (dict(temperature=-0.1), "temperature"),
                      (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                      (dict(logprobs=21), "logprobs"), (dict(seed=-1), "seed")]:
        with pytest.raises(JaxsmolError, match=word):
            SamplingParams(**bad)
