"""Runs of the prefix cache on the tiny engine, each checked against a cold run of the bare engine
(bit for bit): a cache that reports the right numbers but changes the answer is wrong.
Used by tests/test_prefix_cache.py and tests/test_prefix_cache_radix.py."""

from __future__ import annotations

import numpy as np

from jaxsmol.cache.prefix_cache import CacheReport
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

SP = SamplingParams(max_tokens=3, logprobs=3)


def toks(n, seed, lo=3, hi=256):
    """n random token ids (no bos/eos ids), reproducible from `seed`."""
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi, n)]


def distinct(n, first, seed):
    """n tokens starting with `first` (keys with distinct first tokens share nothing)."""
    return [first] + toks(n - 1, seed)


def assert_same(gen, cold):
    assert np.array_equal(gen.prompt_logits, cold.prompt_logits)
    assert gen.output_ids == cold.output_ids
    assert gen.logprobs == cold.logprobs
    assert gen.finish_reason == cold.finish_reason


def run(cache, prompt, sp=SP, **kw):
    gen = generate(cache, prompt, sp, **kw)
    report = gen.report
    assert isinstance(report, CacheReport)
    assert_same(gen, generate(cache.engine, prompt, sp))
    assert report.reused == gen.timings.reused_tokens
    assert report.prefilled == gen.timings.prefilled_tokens == len(prompt) - report.reused
    return gen, report
