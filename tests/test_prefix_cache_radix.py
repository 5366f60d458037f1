"""The prefix cache in radix mode in front of the tiny engine: exact full hits, saving the answer, forks,
namespaces, LRU under a small budget, miss diagnostics (the course exercise's behaviours are in
tests/test_prefix_cache.py). Every warm result is compared with a cold run, bit for bit (`run`).
"""

from __future__ import annotations

import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from cache_runs import SP, assert_same, distinct, run, toks
from jaxsmol.model.config import Config
from jaxsmol.runtime.engine import Engine
from jaxsmol.model.params import init_random
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cache.scheduler.settings import arena_rows


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
    arena = eng.arena(arena_rows(1))  # generate's
    taken = arena.taken_holding
    gen1 = generate(cache, p, SP)  # (compared with a cold run below, after the next turn)
    out = gen1.output_ids
    assert len(out) == 3
    assert arena.taken_holding == taken + 1  # the answer was stored from the prompt's own row
    turn2 = p + out + toks(12, 43)
    gen2, r2 = run(cache, turn2)
    assert r2.matched == r2.reused == len(p) + len(out) > len(p)
    # its restore took the answer's row as it was stored, no copy (same bits: run), and so did the
    # store of its own answer
    assert arena.taken_holding == taken + 3
    assert_same(gen1, generate(eng, p, SP))
    # regenerating at the end of the answer: an exact hit (the saved answer has its logits)
    gen3, r3 = run(cache, p + out)
    assert r3.exact_hit and r3.reused == len(p) + len(out)


def test_without_save_generated_only_the_prompt_is_reused(eng):
    cache = PrefixCache(eng, mode="radix", save_generated=False)
    p = toks(50, 44)
    gen1, _ = run(cache, p)
    gen2, r2 = run(cache, p + gen1.output_ids + toks(12, 45))
    assert r2.reused == len(p)


def test_save_generated_not_exact_stores_the_whole_answer(eng):
    """exact=False stores the answer as exact mode does, re-prefilled in exact chunks (the one driver's
    answer save), so the next turn reuses all of it; only a suffix after a restore takes the fast path."""
    cache = PrefixCache(eng, mode="radix", exact=False)
    p = toks(50, 46)
    gen1 = generate(cache, p, SP)
    turn2 = p + gen1.output_ids + toks(12, 47)
    arena = eng.arena(arena_rows(1))  # generate's
    taken = arena.taken_holding
    gen2 = generate(cache, turn2, SP)
    r2 = gen2.report
    assert r2.reused == len(p) + len(gen1.output_ids)
    assert arena.taken_holding == taken  # its entries are not told exact: always copied in


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
    assert cache.store.bytes_held == (80 + answer_positions) * bpt + (1 + len(set(outs))) * payload_bytes
    # branches of one prompt (tree of thought) reuse the shared trunk
    for j, o in enumerate(sorted(set(outs))):
        gen, r = run(cache, list(p) + list(o) + toks(5, 60 + j))
        assert r.reused == 80 + len(o)


# ---- radix: namespaces ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["single", "radix"])
def test_salt_namespace_never_hits(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    p = toks(40, 70)
    run(cache, p)
    gen, r = run(cache, p, salt="tenant-b")
    assert r.matched == 0 and r.reused == 0 and not r.exact_hit
    salted = PrefixCache(eng, mode=mode, salt="tenant-b")
    salted.store = cache.store  # one store, two salts
    gen, r = run(salted, p)
    assert r.reused == (39 if mode == "single" else 40)  # what tenant-b itself stored in radix


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_other_model_fingerprint_never_hits(eng, mode):
    cache = PrefixCache(eng, mode=mode)
    p = toks(40, 71)
    run(cache, p)
    other = Engine(eng.cfg, eng.params, None, ctx=eng.ctx)
    other._fingerprint = "tiny-other"
    other_cache = PrefixCache(other, mode=mode)
    other_cache.store = cache.store  # one store, two models
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


def test_fingerprint_covers_the_code_of_the_forward(monkeypatch):
    """A snapshot stored (on disk) by a version of the forward or kernels whose bits differ must not
    be restored by another: the fingerprint hashes those sources."""
    from jaxsmol.runtime import engine

    cfg = Config.tiny()
    base = Engine(cfg, init_random(cfg, seed=0), None).fingerprint
    engine.numerics_identity.cache_clear()
    monkeypatch.setattr(engine, "NUMERICS_SOURCES", engine.NUMERICS_SOURCES[:-1])
    try:
        assert Engine(cfg, init_random(cfg, seed=0), None).fingerprint != base
    finally:
        engine.numerics_identity.cache_clear()


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


def test_a_restored_entry_is_released_at_once_and_the_budget_holds(eng, bpt, payload_bytes):
    """A stored prefix that a request restored is released as soon as its state is in the request's
    row: it may be evicted while the rest of the prompt is prefilled, the result is unchanged, and the
    store never holds more than its budget (leases by requests in flight included)."""
    long_n = 340  # > a scheduler step's 128 rows: its prefill spans steps
    cache = PrefixCache(eng, mode="radix", budget_bytes=long_n * bpt + payload_bytes, save_generated=False)
    ns = cache.namespace()
    a = distinct(40, 90, 91)
    run(cache, a)
    prompt = a + toks(long_n - 40, 92)
    sink, sched = Collector(), Scheduler(cache, max_batch=1)
    sched.submit(Request(prompt, [SP], sink, detail=True))
    sched.step()  # admitted: a restored, the first 128 rows of the rest prefilled
    assert sched.prefills and sched.prefills[0].lookup.report.reused == 40 and sched.prefills[0].lookup.match is None
    for i in range(12):  # a is the least recently used throughout
        run(cache, distinct(40, 91 + i, 92 + i))
        assert cache.bytes_held <= cache.budget_bytes
    assert cache.store.match(ns, a).length == 0  # evicted while the prompt that restored it is prefilled
    sched.run()
    assert_same(sink.results[0], generate(eng, prompt, SP))
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
    assert _leased(cache.store) == []  # no request is in flight
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
