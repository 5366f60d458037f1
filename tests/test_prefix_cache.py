"""The prefix cache in front of the tiny engine: the course exercise's behaviours one by one (radix
mode's own are in tests/test_prefix_cache_radix.py).

Every warm result is also compared with a cold run of the bare engine (bit for bit, `run` in
tests/cache_runs.py): a cache that reports the right numbers but changes the answer is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxsmol.model.kv import KVCache
from jaxsmol.cache.prefix_cache import PrefixCache
from cache_runs import distinct, run, toks
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate


# ---- construction -------------------------------------------------------------------------------

def test_bad_settings_are_refused(eng):
    with pytest.raises(JaxsmolError, match="cache mode"):
        PrefixCache(eng, mode="lru")
    with pytest.raises(JaxsmolError, match="budget"):
        PrefixCache(eng, budget_bytes=-1)


# ---- the course exercise: bypasses ------------------------------------------------------------------------------

def test_bypass_mode_off(eng):
    cache = PrefixCache(eng, mode="off")
    p = toks(20, 1)
    for _ in range(2):
        gen, r = run(cache, p)
        assert r.bypass == "cache disabled"
        assert (r.matched, r.reused, r.prefilled, r.saved) == (0, 0, 20, 0)
    s = cache.stats
    assert s.bypasses == {"cache disabled": 2}
    assert (s.lookups, s.hits, s.misses, s.saves, s.restores) == (0, 0, 0, 0, 0)
    assert cache.bytes_held == 0 and s.bytes_held == 0


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_bypass_per_request(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    p = toks(20, 2)
    gen, r = run(cache, p, bypass=True)
    assert r.bypass == "cache disabled" and r.reused == 0
    assert cache.bytes_held == 0  # a bypassed request saves nothing
    gen, r = run(cache, p)  # so the next one misses
    assert r.bypass is None and r.matched == 0 and r.reused == 0
    gen, r = run(cache, p, bypass=True)  # a bypass ignores what is stored
    assert r.bypass == "cache disabled" and r.reused == 0
    assert cache.stats.bypasses == {"cache disabled": 2}
    assert cache.stats.lookups == 1


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_bypass_one_token_prompt(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    run(cache, [7, 8, 9])  # something stored that starts with 7
    gen, r = run(cache, [7])
    assert r.bypass == "prompt has at most one token"
    assert (r.reused, r.prefilled) == (0, 1)
    assert cache.stats.bypasses == {"prompt has at most one token": 1}


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_bypass_prompt_exceeds_capacity(eng, bpt, mode):
    logits_bytes = 4 * eng.cfg.vocab_size if mode == "radix" else 0  # radix also keeps the last logits
    cache = PrefixCache(eng, mode=mode, budget_bytes=10 * bpt + bpt // 2 + logits_bytes)  # capacity: 10 tokens
    assert cache.capacity_tokens == 10
    longest = 11 if mode == "single" else 10  # single stores prompt_n - 1 positions, radix all n
    gen, r = run(cache, toks(longest, 3))
    assert r.bypass is None
    assert cache.bytes_held <= cache.budget_bytes
    gen, r = run(cache, toks(longest + 1, 4))
    assert r.bypass == "prompt exceeds the cache capacity (10 tokens)"
    assert r.reused == 0 and r.prefilled == longest + 1
    assert cache.stats.bypasses == {"prompt exceeds the cache capacity (10 tokens)": 1}
    assert cache.stats.lookups == 1


def test_bypass_reasons_counted_separately(eng, bpt):
    cache = PrefixCache(eng, mode="single", budget_bytes=30 * bpt)
    run(cache, toks(5, 5), bypass=True)
    run(cache, [9])
    run(cache, [10])
    run(cache, toks(40, 6))
    run(cache, toks(5, 7))
    assert cache.stats.bypasses == {"cache disabled": 1, "prompt has at most one token": 2,
                                    "prompt exceeds the cache capacity (30 tokens)": 1}
    assert cache.stats.as_dict()["bypasses"] == dict(cache.stats.bypasses)
    assert cache.stats.lookups == 1


# ---- the course exercise: the prompt_n - 1 cap, match length, restore position ---------------------------

def test_minimal_identical_prompt_reuses_n_minus_1(eng, bpt):
    cache = PrefixCache(eng, mode="single")
    p = toks(50, 10)
    gen, r = run(cache, p)
    assert (r.matched, r.reused, r.prefilled, r.saved) == (0, 0, 50, 49)
    assert cache.store.entries() == [(cache.namespace(), tuple(p[:49]))]
    stored, value, _ = cache.store.state(cache.namespace(), p)
    assert int(KVCache.from_segment(value).pos) == 49
    assert value["k"].shape[3] == 49  # trimmed to its length
    assert cache.bytes_held == 49 * bpt
    gen, r = run(cache, p)
    assert (r.matched, r.reused, r.prefilled) == (49, 49, 1)
    assert gen.timings.reused_tokens == 49 and gen.timings.prefilled_tokens == 1
    assert not r.exact_hit  # the course exercise never skips the last prompt token
    assert r.snapshot_bytes == 49 * bpt


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_match_length_for_a_shared_prefix(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    p = toks(60, 11)
    run(cache, p)
    q = p[:23] + [(p[23] + 1) % 256 or 3] + toks(30, 12)
    gen, r = run(cache, q)
    assert (r.matched, r.reused, r.prefilled) == (23, 23, len(q) - 23)
    assert gen.timings.reused_tokens == 23
    assert r.divergence_pos == 23


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_prompt_that_is_a_prefix_of_the_stored_one(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    p = toks(60, 13)
    run(cache, p)
    gen, r = run(cache, p[:20])
    assert (r.reused, r.prefilled) == (19, 1)  # capped at prompt_n - 1: no logits stored for p[:20]
    assert not r.exact_hit
    assert r.matched == 20  # found in the store; restored only up to prompt_n - 1


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_restore_position_and_continuation(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    p = toks(100, 14)
    run(cache, p)
    for cut in (1, 2, 63, 64, 65, 99):
        q = p[:cut] + toks(40, 100 + cut)
        q[cut] = p[cut] + 1 if p[cut] < 255 else 3  # diverge exactly at `cut`
        cache.flush()
        run(cache, p)
        gen, r = run(cache, q)
        assert r.reused == gen.timings.reused_tokens == cut
        assert r.prefilled == len(q) - cut


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_miss_when_the_first_token_differs(eng, mode):
    """Everything after the first token equal is still a miss: only a common *prefix* is reused."""
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    run(cache, distinct(40, 5, 15))
    gen, r = run(cache, distinct(40, 6, 15))  # same tail, other first token
    assert (r.matched, r.reused) == (0, 0)
    assert r.divergence_pos == 0


# ---- the course exercise: stale entries ignored -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["single", "radix"])
def test_stale_entries_from_a_longer_sequence_are_ignored(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    a = toks(300, 16)
    run(cache, a)
    b = a[:100] + toks(50, 17)
    b[100] = a[100] + 1 if a[100] < 255 else 3
    gen, r = run(cache, b)  # run() compares with the cold result bit for bit
    assert r.reused == 100


def test_stale_slots_beyond_pos_in_a_device_cache_never_matter(eng):
    """Masking by position is enough: a cache whose slots past `pos` still hold another, longer
    sequence's keys and values (not cleared) continues exactly like a cold prefill."""
    import jax.numpy as jnp

    a = toks(300, 18)
    b = a[:100] + toks(60, 19)
    b[100] = a[100] + 1 if a[100] < 255 else 3
    kv = eng.new_cache(eng.slots_needed(0, 300, 0))
    _, kv = eng.prefill(a, kv)
    assert int(kv.pos) == 300
    kv = kv.replace(pos=jnp.asarray(100, jnp.int32))  # positions 100..299 hold a's state: stale for b
    logits, kv = eng.prefill(b, kv)
    cold = generate(eng, b, SamplingParams(max_tokens=0))
    assert np.array_equal(np.asarray(logits[0]), cold.prompt_logits)


# ---- the course exercise: statistics ---------------------------------------------------------------------------

def test_statistics_minimal(eng, bpt):
    cache = PrefixCache(eng, mode="single")
    p = distinct(40, 20, 21)
    reports = []
    reports.append(run(cache, p)[1])  # miss
    reports.append(run(cache, p)[1])  # hit: 39
    q = p[:10] + [p[10] + 1 if p[10] < 255 else 3] + toks(19, 22)
    reports.append(run(cache, q)[1])  # hit: 10
    reports.append(run(cache, p, bypass=True)[1])  # bypass
    reports.append(run(cache, [5])[1])  # bypass
    reports.append(run(cache, distinct(30, 21, 23))[1])  # miss
    assert [r.reused for r in reports] == [0, 39, 10, 0, 0, 0]
    s = cache.stats
    assert s.lookups == 4
    assert (s.hits, s.misses, s.restores, s.exact_hits) == (2, 2, 2, 0)
    assert s.bypasses == {"cache disabled": 1, "prompt has at most one token": 1}
    assert s.saves == 4  # each looked-up request saved its snapshot
    assert s.tokens_reused == 49
    assert s.tokens_prefilled == sum(r.prefilled for r in reports) == 40 + 1 + 20 + 40 + 1 + 30
    assert s.bytes_held == cache.bytes_held == 29 * bpt  # the last snapshot only
    assert s.evictions == 0
    d = s.as_dict()
    assert set(d) >= {"lookups", "hits", "misses", "bypasses", "saves", "restores", "tokens_reused",
                      "tokens_prefilled", "bytes_held", "evictions"}


def test_statistics_radix(eng, bpt, payload_bytes):
    cache = PrefixCache(eng, mode="radix", save_generated=False)
    p = distinct(40, 30, 31)
    r1 = run(cache, p)[1]  # miss
    r2 = run(cache, p)[1]  # exact hit
    q = p[:10] + [p[10] + 1 if p[10] < 255 else 3] + toks(19, 32)
    r3 = run(cache, q)[1]  # partial hit
    r4 = run(cache, [4])[1]  # bypass
    assert (r1.reused, r2.reused, r3.reused) == (0, 40, 10)
    assert r2.exact_hit and not r3.exact_hit
    s = cache.stats
    assert (s.lookups, s.hits, s.exact_hits, s.misses, s.restores) == (3, 2, 1, 1, 2)
    assert s.bypasses == {"prompt has at most one token": 1}
    assert s.tokens_reused == 50
    assert s.tokens_prefilled == 40 + 0 + 20 + 1 == sum(r.prefilled for r in (r1, r2, r3, r4))
    assert s.bytes_held == cache.store.bytes_held == (40 + 20) * bpt + 2 * payload_bytes
    assert s.saves >= 2


def test_generate_many_lives_beside_the_scheduler_not_on_the_cache(eng):
    """generate_many is a function of the scheduler's package (the cache does not import its scheduler:
    no import circle); the method PrefixCache had in 0.1 is gone since 0.3.0."""
    from jaxsmol.cache import generate_many

    prompts, sp = [list(range(10, 30)), list(range(10, 25)) + [99]], SamplingParams(max_tokens=3)
    first = generate_many(PrefixCache(eng), prompts, sp)
    assert [len(rs) for rs in first] == [1, 1] and all(len(rs[0].output_ids) == 3 for rs in first)
    assert not hasattr(PrefixCache, "generate_many")
