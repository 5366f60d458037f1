"""The engine (jaxsmol/runtime/engine.py) on the tiny random model: generation, stopping, validation,
chunking, the bound on compiled programs and the buffers it keeps (the real model:
tests/test_engine_real.py; the sampler itself: tests/test_sampling.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.runtime.chunks import (FAST_BUCKETS, MIN_CAPACITY, PREFILL_BUCKETS, ROW_EXACT_BUCKETS, capacity_for,
                            chunk_plan, prefill_buckets, tight_plan)
from jaxsmol.runtime import programs
from jaxsmol.runtime.engine import Engine, compiled_programs
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import KVCache
from jaxsmol.model.forward import ATTN_BLOCK
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler

PROMPT = [1, 17, 42, 99, 7, 200, 13, 5, 64, 128]


def _ids(n, seed):
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


def _gen(engine, prompt=PROMPT, **sp):
    return generate(engine, prompt, SamplingParams(**sp))


def _streamed(engine, sp, prompt=PROMPT):
    """(the result, the Steps streamed on the way)."""
    steps = []
    return generate(engine, prompt, sp, on_token=steps.append), steps


# ---- compiled programs (first, so later tests reuse what it compiles) ------------------------

def test_compiled_programs_are_closed(tiny_engine):
    """A mixed workload (prompts of 1-600 tokens, any max_tokens, sampling settings, logprobs, clients
    leaving early) makes ready one prefill program per chunk length it meets, one decode step and one
    first-token sampler: lengths and fields are data. A second pass of other lengths adds nothing."""
    programs.clear()  # count from zero, whatever earlier tests compiled
    ctx = tiny_engine.ctx
    everything = tuple(range(256))  # as stop_ids: stop right after the first token

    def run(n, max_tokens, steps=4, seed=0, **sp):
        sink = Collector()  # a streaming client may leave early: after `steps` tokens here
        sink.on_token = lambda i, _: setattr(sink, "cancel", len(sink.steps[i]) >= steps)
        sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=1, speculate="none")
        sched.submit(Request(_ids(n, seed), [SamplingParams(max_tokens=max_tokens, seed=seed, **sp)], sink))
        sched.run()

    for n in (5, 10, 20, 50, 100, 200, 400):  # every bucket (8, 16 and 32 with the CPU kernels, see engine.py)
        run(n, 3, logprobs=n % 3)
        run(n, 600, stop_ids=everything)  # no decode step
    run(600, 3)  # 512 + 128 chunks
    covered = {name: compiled_programs(name) for name in ("prefill_rows", "decode_step", "sample_first")}
    # the chunk lengths up to a step's 128 rows (longer prompts advance 128 rows a step)
    assert covered == {"prefill_rows": len([T for T in tiny_engine.buckets() if T <= 128]), "decode_step": 1,
                       "sample_first": 1}

    def random_pass(seed):
        rng = np.random.default_rng(seed)
        for i in range(30):
            n = int(rng.integers(1, 601))
            m = int(rng.integers(0, ctx - n + 1))
            run(n, m, seed=i, temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.integers(0, 50)),
                top_p=float(rng.choice([1.0, 0.9])), logprobs=int(rng.integers(0, 21)))

    random_pass(1)
    random_pass(2)
    assert {name: compiled_programs(name) for name in covered} == covered


# ---- generation: sampling ------------------------------------------------------------------------

def _check_greedy(engine, prompt, out):
    """Each greedy token is the argmax of one uncached forward over prompt + the tokens before it."""
    ref = engine.logits_all(prompt + out)
    for j, tok in enumerate(out):
        row = ref[len(prompt) - 1 + j]
        assert tok == int(row.argmax()) or row.max() - row[tok] < 1e-5, f"step {j}"


def test_greedy_generation_is_argmax(tiny_engine):
    gen = _gen(tiny_engine, max_tokens=6)
    assert gen.output_ids[0] == int(np.argmax(gen.prompt_logits))
    _check_greedy(tiny_engine, PROMPT, gen.output_ids)


def test_greedy_far_beyond_the_first_attention_block(tiny_engine):
    """A 700-token prompt in a 1024-slot cache: decode at positions 700+ (block 2 of 4)."""
    prompt = _ids(700, 1)
    out = generate(tiny_engine, prompt, SamplingParams(max_tokens=4)).output_ids
    _check_greedy(tiny_engine, prompt, out)


def test_same_seed_same_tokens(tiny_engine):
    sp = dict(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9)
    a = _gen(tiny_engine, seed=7, **sp).output_ids
    _gen(tiny_engine, seed=8, **sp)  # another request in between changes nothing
    assert _gen(tiny_engine, seed=7, **sp).output_ids == a
    assert _gen(tiny_engine, seed=7, temperature=0.8, max_tokens=10).output_ids == \
        _gen(tiny_engine, seed=7, temperature=0.8, max_tokens=10).output_ids


def test_different_seeds_differ(tiny_engine):
    outs = {tuple(_gen(tiny_engine, seed=s, max_tokens=8, temperature=1.0).output_ids) for s in range(5)}
    assert len(outs) > 1


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_engine):
    greedy = _gen(tiny_engine, max_tokens=8).output_ids
    for seed in (0, 1):
        assert _gen(tiny_engine, max_tokens=8, temperature=1.0, top_k=1, seed=seed).output_ids == greedy
        assert _gen(tiny_engine, max_tokens=8, temperature=1.0, top_p=1e-6, seed=seed).output_ids == greedy


def test_logprobs(tiny_engine):
    gen = _gen(tiny_engine, max_tokens=3, logprobs=4)
    assert len(gen.logprobs) == 3
    first = gen.logprobs[0]
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(gen.prompt_logits)))
    assert [i for i, _ in first["top"]] == list(np.argsort(-logp)[:4])
    assert first["logprob"] == pytest.approx(float(logp[first["token"]]), abs=1e-5)
    assert first["top"][0] == (first["token"], pytest.approx(first["logprob"]))


# ---- generation: stopping ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy12(tiny_engine):
    """12 greedy tokens and an index j whose token first occurs there (j >= 1 when possible)."""
    out = _gen(tiny_engine, max_tokens=12).output_ids
    assert 2 not in out, "test premise: the tiny model's greedy output has no eos (id 2)"
    j = next((i for i in range(1, len(out)) if out[i] not in out[:i]), 0)
    return out, j


def test_max_tokens_and_length(tiny_engine, greedy12):
    out, _ = greedy12
    gen = _gen(tiny_engine, max_tokens=5)
    assert gen.output_ids == out[:5] and gen.finish_reason == "length"
    assert gen.timings.generated_tokens == 5 and gen.timings.prompt_tokens == len(PROMPT)
    gen = _gen(tiny_engine, max_tokens=0)
    assert gen.output_ids == [] and gen.finish_reason == "length" and gen.prompt_logits.shape == (256,)


def test_stop_ids(tiny_engine, greedy12):
    out, j = greedy12
    gen = _gen(tiny_engine, max_tokens=12, stop_ids=(out[j],))
    assert gen.output_ids == out[:j + 1] and gen.finish_reason == "stop"


def test_eos_stops(tiny_engine, greedy12):
    out, j = greedy12
    cfg = dataclasses.replace(tiny_engine.cfg, eos_ids=(out[j],))
    eng = Engine(cfg, tiny_engine.params, None, ctx=1024)
    gen = generate(eng, PROMPT, SamplingParams(max_tokens=12))
    assert gen.output_ids == out[:j + 1] and gen.finish_reason == "stop"


class FakeTokenizer:
    """Just enough for IncrementalDecoder: token i decodes to "<i>"."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{int(i)}>" for i in ids)


def test_stop_strings(tiny_engine, greedy12):
    out, j = greedy12
    eng = Engine(tiny_engine.cfg, tiny_engine.params, FakeTokenizer(), ctx=1024)
    text = lambda ids: FakeTokenizer().decode(ids)  # noqa: E731

    # a stop string that is one whole token: the text ends before it, the token is still emitted
    gen, steps = _streamed(eng, SamplingParams(max_tokens=12, stop_strings=(f"<{out[j]}>",)))
    assert gen.output_ids == out[:j + 1] and gen.finish_reason == "stop" and gen.stop_string == f"<{out[j]}>"
    assert gen.text == text(out[:j]) and "".join(s.text for s in steps) == gen.text

    # a stop string spanning two tokens: cut where it starts
    s = f"{out[1]}><{out[2]}"
    k = next(k for k in range(1, 13) if s in text(out[:k]))
    gen, steps = _streamed(eng, SamplingParams(max_tokens=12, stop_strings=("never", s)))
    assert gen.output_ids == out[:k] and gen.finish_reason == "stop" and gen.stop_string == s
    assert gen.text == text(out[:k])[: text(out[:k]).find(s)]

    # no hit: the whole text, finish "length"
    gen = generate(eng, PROMPT, SamplingParams(max_tokens=4, stop_strings=("never",)))
    assert gen.text == text(out[:4]) and gen.finish_reason == "length" and gen.stop_string is None


def test_streamed_text_equals_final_text_with_a_spanning_stop_string(tiny_engine, greedy12):
    out, _ = greedy12
    eng = Engine(tiny_engine.cfg, tiny_engine.params, FakeTokenizer(), ctx=1024)
    gen, steps = _streamed(eng, SamplingParams(max_tokens=12, stop_strings=(f"{out[1]}><{out[2]}",)))
    streamed = "".join(step.text for step in steps)
    assert gen.finish_reason == "stop"
    assert streamed == gen.text



class HalfCharTokenizer(FakeTokenizer):
    """Token `half` is the first byte of a two-byte character: it decodes to U+FFFD when last, "é" otherwise."""

    def __init__(self, half):
        self.half = half

    def decode(self, ids, skip_special_tokens=False):
        ids = [int(i) for i in ids]
        return "".join(("\ufffd" if k == len(ids) - 1 else "é") if i == self.half else f"<{i}>"
                       for k, i in enumerate(ids))


def test_streamed_text_equals_final_text_when_the_last_token_is_incomplete(tiny_engine, greedy12):
    out, _ = greedy12
    eng = Engine(tiny_engine.cfg, tiny_engine.params, HalfCharTokenizer(out[3]), ctx=1024)
    gen, steps = _streamed(eng, SamplingParams(max_tokens=4))
    streamed = "".join(step.text for step in steps)
    assert gen.output_ids == out[:4] and gen.finish_reason == "length"
    assert streamed == gen.text

# ---- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, max_tokens, words", [
    ([], 0, ["empty"]),
    ([1, 256], 0, ["256", "[0, 256)"]),
    ([1, -1], 0, ["-1", "[0, 256)"]),
    (["a"], 0, ["integers"]),
    ([1, 2], -1, ["max_tokens", "-1"]),
    ([1] * 1000, 25, ["1000", "25", "1024"]),
    ([1] * 1025, 0, ["1025", "1024"]),
])
def test_check_prompt_errors(tiny_engine, ids, max_tokens, words):
    with pytest.raises(JaxsmolError) as e:
        tiny_engine.check_prompt(ids, max_tokens)
    for w in words:
        assert w in str(e.value)


def test_check_prompt_accepts_the_limit(tiny_engine):
    assert tiny_engine.check_prompt(np.array([1] * 1000), 24) == [1] * 1000
    with pytest.raises(JaxsmolError, match="exceeds"):
        generate(tiny_engine, [1] * 1000, SamplingParams(max_tokens=25))


def test_engine_context_must_fit_the_model(tiny_engine):
    with pytest.raises(JaxsmolError, match="1024"):
        Engine(tiny_engine.cfg, tiny_engine.params, ctx=1025)
    assert Engine(tiny_engine.cfg, tiny_engine.params).ctx == 1024


# ---- chunking, capacities, compile bound ---------------------------------------------------------

def test_tight_plan_pads_less_in_at_most_one_more_chunk():
    R = ROW_EXACT_BUCKETS
    assert tight_plan(45, R) == [32, 16] and tight_plan(40, R) == [32, 8] and tight_plan(65, R) == [64, 8]
    assert tight_plan(20, R) == [32] and tight_plan(49, R) == [64] and tight_plan(100, R) == [128]  # no saving
    assert tight_plan(12, R) == [16] and tight_plan(24, R) == [32]  # saves 8 rows: not worth a chunk
    assert tight_plan(1000, R) == [512, 512] and tight_plan(1030, R) == [512, 512, 8]
    assert tight_plan(45) == [64] and tight_plan(130) == [128, 64]  # XLA's buckets
    for n in range(1, 1100):
        plan = tight_plan(n, R)
        assert sum(plan) >= n and sum(plan) <= sum(chunk_plan(n, R)) and all(b in R for b in plan)


def test_chunk_plan():
    assert chunk_plan(0) == []
    assert chunk_plan(1) == [64] and chunk_plan(64) == [64] and chunk_plan(65) == [128]
    assert chunk_plan(300) == [512] and chunk_plan(512) == [512]
    assert chunk_plan(513) == [512, 64] and chunk_plan(1100) == [512, 512, 128]
    assert chunk_plan(10, ROW_EXACT_BUCKETS) == [16] and chunk_plan(520, ROW_EXACT_BUCKETS) == [512, 8]
    assert prefill_buckets(True, cpu_kernels=True) == ROW_EXACT_BUCKETS
    assert prefill_buckets(True, cpu_kernels=False) == PREFILL_BUCKETS and prefill_buckets(False) == FAST_BUCKETS
    for n in range(1, 2200, 7):
        plan = chunk_plan(n)
        assert set(plan) <= set(PREFILL_BUCKETS) and all(t == 512 for t in plan[:-1])
        rest = n - 512 * (len(plan) - 1)
        assert 0 < rest <= plan[-1] and plan[-1] == min(b for b in PREFILL_BUCKETS if b >= rest)


def test_capacity_for():
    assert capacity_for(0) == capacity_for(1) == capacity_for(MIN_CAPACITY) == MIN_CAPACITY == 512
    assert capacity_for(513) == 1024 and capacity_for(2048) == 2048 and capacity_for(2049) == 4096
    for s in range(1, 9000, 97):
        cap = capacity_for(s)
        assert cap >= s and cap % ATTN_BLOCK == 0 and (cap == MIN_CAPACITY or cap // 2 < s)


def test_slots_needed_covers_padding_and_decode(tiny_engine):
    assert tiny_engine.cfg.cpu_kernels  # so its exact chunks may have 16 rows (engine.py)
    assert tiny_engine.slots_needed(0, 10, 5) == 16 and tiny_engine.slots_needed(0, 10, 5, exact=False) == 16
    assert tiny_engine.slots_needed(0, 10, 100) == 110
    assert tiny_engine.slots_needed(0, 600, 0) == 640
    assert tiny_engine.slots_needed(500, 600, 0) == 628


def test_restore_reuses_its_staging_buffers_and_counts_them(tiny_cfg):
    """Restores copy a host snapshot through two staging buffers (keys, values) kept between calls,
    counted in pool_bytes; a shorter restore reuses them, and the restored positions are the snapshot's."""
    from jaxsmol.model.params import init_random

    engine = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=1024)
    _, kv = engine.prefill(_ids(300, 0), engine.new_cache(engine.slots_needed(0, 300, 0)))
    snapshot = jax.device_get(kv)
    first = engine.restore(snapshot, 512, 300)
    staged = [raw.ctypes.data for raw in engine.staging.raw]
    assert engine.pool_bytes == engine.staging.nbytes > 0
    second = engine.restore(snapshot, 512, 60)
    assert [raw.ctypes.data for raw in engine.staging.raw] == staged  # reused, not allocated again
    for got, n in ((first, 300), (second, 60)):
        assert int(got.pos) == n
        for a, b in ((got.k, snapshot.k), (got.v, snapshot.v)):
            np.testing.assert_array_equal(np.asarray(a)[..., :n, :], b[..., :n, :])


def test_an_arena_row_holds_only_exact_states(tiny_engine):
    """How many of a row's first positions hold exact state after a decode step (what a later take of
    the row may reuse without a copy): the prompt after a cold prefill or exact chunks onto a prefix
    restored as exact; the restored prefix alone after a one-row chunk (the fast path's, not exact);
    nothing onto a prefix restored as not exact."""
    from jaxsmol.runtime.batch import free_mask, row_settings

    prompt = _ids(40, 1)
    arena = tiny_engine.arena()
    with arena.borrowed() as row:
        arena.fill(row, prompt)
        snapshot = arena.segment(row, 0, 40)
    greedy = row_settings([SamplingParams()], [0], [None], free_mask(tiny_engine.cfg.vocab_size, 1))

    def held(prefix_len=0, told=False, exact=True):
        with arena.borrowed() as row:
            assert arena.pos[row] == arena.exact[row] == 0
            if prefix_len:
                arena.restore(row, [snapshot], 0, prefix_len, exact=told)
            arena.fill(row, prompt, exact)
            arena.decode([row], np.array([7], np.int32), greedy)
            return arena.exact[row]

    assert held() == len(prompt)
    assert held(30, told=True) == len(prompt)
    assert held(39, told=True, exact=False) == 39
    assert held(30) == 0


def test_a_snapshot_that_does_not_fit_is_a_clear_error(tiny_engine):
    """A host snapshot of another layout, or longer than the cache asked for, is refused by name."""
    c = tiny_engine.cfg
    good = np.zeros((c.n_layers, 1, c.n_kv_heads, 600, c.head_dim), np.float32)
    other = np.zeros((c.n_layers, 1, 1, c.n_kv_heads, c.head_dim), np.float32)  # slots before heads
    with pytest.raises(JaxsmolError, match=r"snapshot k has shape"):
        tiny_engine.restore(KVCache(k=other, v=other, pos=np.int32(1)), 512)
    with pytest.raises(JaxsmolError, match=r"600 positions does not fit a cache of 512 slots"):
        tiny_engine.restore(KVCache(k=good, v=good, pos=np.int32(600)), 512)
    assert int(tiny_engine.restore(KVCache(k=good, v=good, pos=np.int32(600)), 512, 500).pos) == 500


@pytest.mark.parametrize("n", [1, 4])
def test_warmup_for_a_prompt_compiles_what_its_probe_runs(caplog, n):
    """engine.warmup(n) compiles every prefill program a prompt of n tokens runs, the exact
    path's chunk too (a one-token prompt runs an 8-row chunk with the kernels: it was left out, and the
    lab's one-token probe paid ~0.5 s in its cold run). Its own shapes, so no earlier test compiled them."""
    import logging

    import jax

    from jaxsmol.cache.probe import run_probe
    from jaxsmol.model.config import Config
    from jaxsmol.model.params import init_random
    from jaxsmol.runtime.engine import Engine

    cfg = Config.tiny(n_layers=5, vocab_size=352 + 32 * n)
    engine = Engine(cfg, init_random(cfg), None, ctx=256)
    engine._fingerprint = f"warmup-{n}"
    engine.warmup(n)
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        result = run_probe(engine, list(range(3, 3 + n)), max_tokens=1, warmup=False)
    assert result["identical"]
    compiled = [r.getMessage() for r in caplog.records if "prefill_rows" in r.getMessage()]
    assert not compiled, compiled
