"""The prefix cache in front of the tiny engine: the course exercise's behaviours one by one, then radix mode.

Every warm result is also compared with a cold run of the bare engine (bit for bit): a cache that
reports the right numbers but changes the answer is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxsmol.kv import KVCache
from cache.prefix_cache import CacheReport, PrefixCache
from jaxsmol.config import Config
from jaxsmol.engine import Engine
from jaxsmol.errors import JaxsmolError
from jaxsmol.params import init_random
from jaxsmol.sampling import SamplingParams

SP = SamplingParams(max_tokens=3, logprobs=3)


@pytest.fixture(scope="module")
def eng(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def bpt(eng):
    return eng.kv_bytes_per_token  # 512 on the tiny config


@pytest.fixture(scope="module")
def payload_bytes(eng):
    return eng.cfg.vocab_size * 4  # the last position's float32 logits


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
    gen, report = cache.generate(prompt, sp, **kw)
    assert isinstance(report, CacheReport)
    assert_same(gen, cache.engine.generate(prompt, sp))
    assert report.reused == gen.timings.reused_tokens
    assert report.prefilled == gen.timings.prefilled_tokens == len(prompt) - report.reused
    return gen, report


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


@pytest.mark.parametrize("mode", ["minimal", "radix"])
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


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_bypass_one_token_prompt(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    run(cache, [7, 8, 9])  # something stored that starts with 7
    gen, r = run(cache, [7])
    assert r.bypass == "prompt has at most one token"
    assert (r.reused, r.prefilled) == (0, 1)
    assert cache.stats.bypasses == {"prompt has at most one token": 1}


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_bypass_prompt_exceeds_capacity(eng, bpt, mode):
    logits_bytes = 4 * eng.cfg.vocab_size if mode == "radix" else 0  # radix also keeps the last logits
    cache = PrefixCache(eng, mode=mode, budget_bytes=10 * bpt + bpt // 2 + logits_bytes)  # capacity: 10 tokens
    assert cache.capacity_tokens == 10
    longest = 11 if mode == "minimal" else 10  # minimal stores prompt_n - 1 positions, radix all n
    gen, r = run(cache, toks(longest, 3))
    assert r.bypass is None
    assert cache.bytes_held <= cache.budget_bytes
    gen, r = run(cache, toks(longest + 1, 4))
    assert r.bypass == "prompt exceeds the cache capacity (10 tokens)"
    assert r.reused == 0 and r.prefilled == longest + 1
    assert cache.stats.bypasses == {"prompt exceeds the cache capacity (10 tokens)": 1}
    assert cache.stats.lookups == 1


def test_bypass_reasons_counted_separately(eng, bpt):
    cache = PrefixCache(eng, mode="minimal", budget_bytes=30 * bpt)
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
    cache = PrefixCache(eng, mode="minimal")
    p = toks(50, 10)
    gen, r = run(cache, p)
    assert (r.matched, r.reused, r.prefilled, r.saved) == (0, 0, 50, 49)
    assert cache.single.snapshot.tokens == tuple(p[:49])
    assert int(KVCache.from_segment(cache.single.snapshot.value).pos) == 49
    assert cache.single.snapshot.value["k"].shape[2] == 49  # trimmed to its length
    assert cache.bytes_held == 49 * bpt
    gen, r = run(cache, p)
    assert (r.matched, r.reused, r.prefilled) == (49, 49, 1)
    assert gen.timings.reused_tokens == 49 and gen.timings.prefilled_tokens == 1
    assert not r.exact_hit  # the course exercise never skips the last prompt token
    assert r.snapshot_bytes == 49 * bpt


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_match_length_for_a_shared_prefix(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    p = toks(60, 11)
    run(cache, p)
    q = p[:23] + [(p[23] + 1) % 256 or 3] + toks(30, 12)
    gen, r = run(cache, q)
    assert (r.matched, r.reused, r.prefilled) == (23, 23, len(q) - 23)
    assert gen.timings.reused_tokens == 23
    assert r.divergence_pos == 23


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_prompt_that_is_a_prefix_of_the_stored_one(eng, mode):
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    p = toks(60, 13)
    run(cache, p)
    gen, r = run(cache, p[:20])
    assert (r.reused, r.prefilled) == (19, 1)  # capped at prompt_n - 1: no logits stored for p[:20]
    assert not r.exact_hit
    assert r.matched == (19 if mode == "minimal" else 20)


@pytest.mark.parametrize("mode", ["minimal", "radix"])
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
        assert gen.pos == len(q) + SP.max_tokens - 1  # continued from the restored position


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_miss_when_the_first_token_differs(eng, mode):
    """Everything after the first token equal is still a miss: only a common *prefix* is reused."""
    cache = PrefixCache(eng, mode=mode, save_generated=False)
    run(cache, distinct(40, 5, 15))
    gen, r = run(cache, distinct(40, 6, 15))  # same tail, other first token
    assert (r.matched, r.reused) == (0, 0)
    assert r.divergence_pos == 0


# ---- the course exercise: stale entries ignored -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["minimal", "radix"])
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
    cold = eng.generate(b, SamplingParams(max_tokens=0))
    assert np.array_equal(np.asarray(logits[0]), cold.prompt_logits)


# ---- the course exercise: statistics ---------------------------------------------------------------------------

def test_statistics_minimal(eng, bpt):
    cache = PrefixCache(eng, mode="minimal")
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
    assert s.bytes_held == cache.radix.bytes_held == (40 + 20) * bpt + 2 * payload_bytes
    assert s.saves >= 2


# ---- radix: exact full hit ------------------------------------------------------------------------

@pytest.mark.parametrize("save_generated", [False, True])
def test_exact_full_hit(eng, save_generated):
    cache = PrefixCache(eng, mode="radix", save_generated=save_generated)
    p = toks(70, 40)
    sampled = SamplingParams(max_tokens=3, logprobs=3, temperature=0.8, seed=5)
    for sp in (SP, sampled):
        cache.flush()
        run(cache, p, sp)
        gen, r = run(cache, p, sp)  # bitwise equal to cold (run checks)
        assert r.exact_hit
        assert (r.matched, r.reused, r.prefilled) == (70, 70, 0)
        assert gen.timings.prefilled_tokens == 0
        assert r.divergence_pos is None


def test_exact_hit_with_max_tokens_zero(eng):
    cache = PrefixCache(eng, mode="radix")
    p = toks(30, 41)
    sp = SamplingParams(max_tokens=0)
    run(cache, p, sp)
    gen, r = run(cache, p, sp)
    assert r.exact_hit and gen.output_ids == []


# ---- radix: save after generation -------------------------------------------------------------

def test_save_after_generation_next_turn_reuses_the_answer(eng):
    cache = PrefixCache(eng, mode="radix")
    p = toks(50, 42)
    gen1, r1 = run(cache, p)
    out = gen1.output_ids
    assert len(out) == 3
    turn2 = p + out + toks(12, 43)
    gen2, r2 = run(cache, turn2)
    assert r2.matched == r2.reused == len(p) + len(out) > len(p)
    # regenerating at the end of the answer: an exact hit (the saved answer has its logits)
    gen3, r3 = run(cache, p + out)
    assert r3.exact_hit and r3.reused == len(p) + len(out)


def test_without_save_generated_only_the_prompt_is_reused(eng):
    cache = PrefixCache(eng, mode="radix", save_generated=False)
    p = toks(50, 44)
    gen1, _ = run(cache, p)
    gen2, r2 = run(cache, p + gen1.output_ids + toks(12, 45))
    assert r2.reused == len(p)


def test_save_generated_not_exact_reuses_the_decode_state(eng):
    """exact=False stores the decode state as is (cheaper, not bitwise): all but the last output
    token, whose state decode never computed."""
    cache = PrefixCache(eng, mode="radix", exact=False)
    p = toks(50, 46)
    gen1, _ = cache.generate(p, SP)
    turn2 = p + gen1.output_ids + toks(12, 47)
    gen2, r2 = cache.generate(turn2, SP)
    assert r2.reused == len(p) + len(gen1.output_ids) - 1


# ---- radix: fork -----------------------------------------------------------------------------------

def test_fork_samples_share_one_snapshot(eng, bpt, payload_bytes):
    cache = PrefixCache(eng, mode="radix")
    p = toks(80, 50)
    seeds = [0, 1, 2, 3, 4]
    outs = []
    for i, seed in enumerate(seeds):
        sp = SamplingParams(max_tokens=3, logprobs=3, temperature=1.0, seed=seed)
        gen, r = run(cache, p, sp)  # equal to the cold output for this seed
        if i == 0:
            assert r.reused == 0
        else:
            assert r.exact_hit and r.reused == 80 and r.prefilled == 0
        outs.append(tuple(gen.output_ids))
    assert len(set(outs)) > 1  # the samples did differ
    # the prompt is stored once; each distinct answer adds its own positions and logits
    answer_positions = len({o[: i + 1] for o in outs for i in range(len(o))})
    assert cache.radix.bytes_held == (80 + answer_positions) * bpt + (1 + len(set(outs))) * payload_bytes
    # branches of one prompt (tree of thought) reuse the shared trunk
    for j, o in enumerate(sorted(set(outs))):
        gen, r = run(cache, list(p) + list(o) + toks(5, 60 + j))
        assert r.reused == 80 + len(o)


# ---- radix: namespaces ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_salt_namespace_never_hits(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    p = toks(40, 70)
    run(cache, p)
    gen, r = run(cache, p, salt="tenant-b")
    assert r.matched == 0 and r.reused == 0 and not r.exact_hit
    salted = PrefixCache(eng, mode=mode, salt="tenant-b")
    salted.radix, salted.single = cache.radix, cache.single  # one store, two salts
    gen, r = run(salted, p)
    assert r.reused == (39 if mode == "minimal" else 40)  # what tenant-b itself stored in radix


@pytest.mark.parametrize("mode", ["minimal", "radix"])
def test_other_model_fingerprint_never_hits(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    p = toks(40, 71)
    run(cache, p)
    other = Engine(eng.cfg, eng.params, None, ctx=eng.ctx)
    other._fingerprint = "tiny-other"
    other_cache = PrefixCache(other, mode=mode)
    other_cache.radix, other_cache.single = cache.radix, cache.single  # one store, two models
    gen, r = run(other_cache, p)
    assert r.matched == 0 and r.reused == 0
    if mode == "radix":
        gen, r = run(cache, p)  # the first model still hits its own entry
        assert r.exact_hit


def test_fingerprint_covers_weights_config_and_dtype():
    import jax.numpy as jnp

    cfg = Config.tiny()
    base = Engine(cfg, init_random(cfg, seed=0), None).fingerprint
    assert Engine(cfg, init_random(cfg, seed=0), None).fingerprint == base
    assert Engine(cfg, init_random(cfg, seed=1), None).fingerprint != base
    cfg2 = Config.tiny(rms_norm_eps=1e-6)
    assert Engine(cfg2, init_random(cfg2, seed=0), None).fingerprint != base
    assert Engine(cfg, init_random(cfg, seed=0, dtype=jnp.bfloat16), None).fingerprint != base


# ---- radix: LRU under a small budget, entries in use ------------------------------------------

def test_lru_under_a_small_budget(eng, bpt, payload_bytes):
    entry = 40 * bpt + payload_bytes
    cache = PrefixCache(eng, mode="radix", budget_bytes=2 * entry + entry // 2, save_generated=False)
    a, b, c = distinct(40, 80, 81), distinct(40, 81, 82), distinct(40, 82, 83)
    run(cache, a)
    run(cache, b)
    assert cache.stats.evictions == 0
    assert run(cache, a)[1].exact_hit  # a is now more recent than b
    run(cache, c)  # over budget: evicts b, the least recently used
    assert cache.stats.evictions == 1
    assert cache.stats.bytes_held == cache.bytes_held <= cache.budget_bytes
    assert run(cache, a)[1].exact_hit
    assert run(cache, c)[1].exact_hit
    gen, r = run(cache, b)
    assert r.matched == 0  # evicted (and now stored again, evicting a)
    assert cache.stats.evictions == 2
    assert cache.bytes_held <= cache.budget_bytes


def test_entry_in_use_is_not_evicted(eng, bpt, payload_bytes):
    entry = 40 * bpt + payload_bytes
    cache = PrefixCache(eng, mode="radix", budget_bytes=2 * entry, save_generated=False)
    ns = cache.namespace()
    a = distinct(40, 90, 91)
    run(cache, a)
    req = cache.start(a, SP)  # an exact hit, in use until iterated to the end
    assert req.report.exact_hit
    for i in range(3):  # a is the least recently used throughout
        run(cache, distinct(40, 91 + i, 92 + i))
    assert cache.radix.match(ns, a).length == 40  # still there
    steps = list(req)
    assert len(steps) == 3
    assert_same(req.gen, eng.generate(a, SP))
    for i in range(3):
        run(cache, distinct(40, 95 + i, 96 + i))
    assert cache.radix.match(ns, a).length == 0  # released: evicted like any other
    assert cache.bytes_held <= cache.budget_bytes


def test_partial_hits_leave_nothing_pinned(eng, bpt, payload_bytes):
    """A partial hit inside a stored edge, then saving the prompt (which splits that edge), must leave
    no lease behind: once the requests are done, LRU can evict every entry."""
    entry = 40 * bpt + payload_bytes
    cache = PrefixCache(eng, mode="radix", budget_bytes=3 * entry, save_generated=False)
    a = distinct(40, 100, 101)
    run(cache, a)
    b = a[:20] + toks(20, 102)
    b[20] = a[20] + 1 if a[20] < 255 else 3
    gen, r = run(cache, b)
    assert r.reused == 20
    assert _leased(cache.radix) == []  # no request is in flight
    for i in range(4):  # a, b and their shared trunk are now the least recently used
        run(cache, distinct(40, 103 + i, 104 + i))
    gen, r = run(cache, a)
    assert r.matched == 0, "the trunk shared by a and b stayed pinned after its requests ended"


def _leased(store):
    """(first tokens, leases) of every node still leased."""
    stack, out = list(store._roots.values()), []
    while stack:
        node = stack.pop()
        if node.parent is not None and node.leases:
            out.append((node.tokens[:3], node.leases))
        stack.extend(node.children.values())
    return out


# ---- radix: miss diagnostics ----------------------------------------------------------------------

def test_miss_diagnostics(eng):
    cache = PrefixCache(eng, mode="radix", save_generated=False)
    a = distinct(50, 110, 111)
    run(cache, a)
    b = a[:20] + toks(10, 112)
    b[20] = a[20] + 1 if a[20] < 255 else 3
    gen, r = run(cache, b)
    assert (r.matched, r.divergence_pos, r.nearest_len) == (20, 20, 50)
    gen, r = run(cache, distinct(30, 111, 113))  # nothing shares its first token
    assert (r.matched, r.reused, r.divergence_pos, r.nearest_len) == (0, 0, 0, 0)
    gen, r = run(cache, a)
    assert r.exact_hit and r.divergence_pos is None
    gen, r = run(cache, a[:30])  # a stored prefix, no logits for it
    assert (r.matched, r.reused, r.divergence_pos, r.nearest_len) == (30, 29, None, 50)
