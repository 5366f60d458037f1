"""Helpers of the scheduler tests (test_scheduler.py, test_scheduler_chunks.py)."""

from __future__ import annotations

import numpy as np

from jaxsmol.cache.scheduler.many import generate_many
from jaxsmol.cache.prefix_cache import PrefixCache


def prompts(seed: int, lengths) -> list[list[int]]:
    """Random token prompts of the given lengths (ids 3..255: the tiny vocabulary, no special ids)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=n)] for n in lengths]


def run_alone(engine, prompt, sp, **kw):
    """A prompt's answer alone in a batch-invariant scheduler: what it must equal among others."""
    return generate_many(PrefixCache(engine, mode="off"), [prompt], sp, batch_invariant=True, max_batch=4, **kw)[0]
