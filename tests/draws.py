"""Draws from the sampler (jaxsmol/runtime/sampling.py `sample_rows`) for its tests: each row of logits
sampled n times, draw i with seed i, so the draws' frequencies follow the distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.runtime.sampling import sample_rows
from jaxsmol.runtime.structured import all_allowed

_sample = jax.jit(sample_rows)


def draws(logits, n: int, temperature=1.0, top_k=0, top_p=1.0, allowed=None) -> np.ndarray:
    """[n, B] token ids: logits [B, V] (or [V], B = 1) sampled n times under the packed mask `allowed`
    [B, ceil(V / 32)] (None: every id), draw i keyed by seed i at step 0."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    B, V = logits.shape
    allowed = all_allowed(B, V) if allowed is None else np.asarray(allowed)
    W = n * B
    out = _sample(jnp.asarray(np.tile(logits, (n, 1))), temperature=jnp.full(W, temperature, jnp.float32),
                  top_k=jnp.full(W, top_k, jnp.int32), top_p=jnp.full(W, top_p, jnp.float32),
                  seed_lo=jnp.asarray(np.repeat(np.arange(n, dtype=np.uint32), B)), seed_hi=jnp.zeros(W, jnp.uint32),
                  step=jnp.zeros(W, jnp.int32), allowed=jnp.asarray(np.tile(allowed, (n, 1))))
    return np.asarray(out).reshape(n, B)
