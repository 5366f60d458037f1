"""Speculation changes nothing but speed: with drafts verified (`speculate="ngram"`), the token ids,
log-probabilities and finish reasons equal plain decoding's bit for bit, greedy and sampled, alone and
in a batch; and the verify step's rows have a decode step's bits (the attention kernel's as_steps).

Prompts that repeat themselves make the tiny random model loop, so drafts are accepted and the
identity is tested where it matters (each test asserts that drafts were accepted)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import _run, generate, generate_many
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cache.scheduler.speculation import NgramDrafts, Speculator, expected, speculating
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime.kv_arena import KVArena
from jaxsmol.runtime.sampling import SamplingParams


def looping_prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [(lambda base: base * 3 + base[:5])(rng.integers(3, 256, 10).tolist()) for _ in range(count)]


def assert_same(a, b, what=""):
    assert a.output_ids == b.output_ids, what
    assert a.logprobs == b.logprobs, what
    assert a.finish_reason == b.finish_reason, what


@pytest.mark.parametrize("start", [7, 300])  # before and past the decode kernel's split of the keys in two
def test_verify_rows_have_decode_step_bits(tiny_engine, start):
    """A verify step's rows (forward's as_steps over two rows of an arena, one of them idle) have the
    logits and leave the keys and values that one-token decode steps give, bit for bit."""
    from jaxsmol.model.forward import forward

    eng, rng = tiny_engine, np.random.default_rng(start)
    run = jax.jit(forward, static_argnames=("cfg", "all_logits", "as_steps"))
    prompt, tokens = rng.integers(3, 256, start).tolist(), rng.integers(3, 256, 6).tolist()
    arena = KVCache.zeros(eng.cfg, 1024, batch=2, dtype=eng.cache_dtype)
    rows = jnp.asarray([0, 1], jnp.int32)  # row 0 idle, at position 0
    _, kv = run(eng.params, jnp.asarray([prompt]), jnp.asarray([start], jnp.int32),
                             arena.replace(pos=jnp.zeros((1,), jnp.int32)), eng.cfg, rows=rows[1:])
    before = (np.array(kv.k), np.array(kv.v))
    stepped, steps = kv, []
    for i, t in enumerate(tokens):  # plain decoding, one token a step
        logits, stepped = run(eng.params, jnp.asarray([[0], [t]], jnp.int32), jnp.ones((2,), jnp.int32),
                                           stepped.replace(pos=jnp.asarray([0, start + i], jnp.int32)), eng.cfg,
                                           rows=rows)
        steps.append(np.asarray(logits[1]))
    chunk = jnp.asarray([[0] * 6, tokens], jnp.int32)
    logits, verified = run(eng.params, chunk, jnp.asarray([1, 6], jnp.int32),
                                        KVCache(k=before[0], v=before[1], pos=jnp.asarray([0, start], jnp.int32)),
                                        eng.cfg, all_logits=True, as_steps=True, rows=rows)
    assert np.array_equal(np.asarray(logits[1]), np.stack(steps))
    n = start + len(tokens)
    assert np.array_equal(np.asarray(verified.k[:, 1, :, :n]), np.asarray(stepped.k[:, 1, :, :n]))
    assert np.array_equal(np.asarray(verified.v[:, 1, :, :n]), np.asarray(stepped.v[:, 1, :, :n]))


def verifying(sched: Scheduler) -> Scheduler:
    """sched verifying whenever a row drafts (not only where its measured step times say it pays), so
    that a test's verify steps do not depend on the machine's speed."""
    if sched.speculator is not None:
        sched.speculator.adaptive = False
    return sched


def run_one(engine, prompt, sp, speculate):
    sched = verifying(Scheduler(PrefixCache(engine, mode="off"), max_batch=1, speculate=speculate))
    result = _run(sched, [Request(list(prompt), [sp], Collector(), detail=True)])[0][0]
    return result, sched.stats


@pytest.mark.parametrize("temperature", [0.0, 0.3])  # (the tiny model's flat logits: 0.8 would accept little)
def test_alone_equals_plain_decoding(tiny_engine, temperature):
    accepted = 0
    for i, prompt in enumerate(looping_prompts(1, 4)):
        sp = SamplingParams(max_tokens=40, temperature=temperature, top_p=0.9 if temperature else 1.0, seed=i,
                            logprobs=2, ignore_eos=True)
        plain, _ = run_one(tiny_engine, prompt, sp, "none")
        spec, stats = run_one(tiny_engine, prompt, sp, "ngram")
        assert_same(spec, plain, f"prompt {i}")
        accepted += stats.accepted
    assert accepted > 0  # drafts were verified and kept: the identity held where it is at stake


def test_cache_drafts_an_answer_stored_before(tiny_engine):
    """speculate="cache": a request asked again drafts the answer the prefix cache stored after its
    prompt (the answer kept for the next turn); a fresh prompt (no loops) drafts nothing from its own tokens."""
    cache = PrefixCache(tiny_engine)
    prompt = np.random.default_rng(4).permutation(np.arange(3, 256))[:30].tolist()  # no n-gram repeats
    sp = SamplingParams(max_tokens=16, temperature=0.5, seed=2, logprobs=1, ignore_eos=True)

    def ask(mode):
        sched = verifying(Scheduler(cache, max_batch=1, speculate=mode))
        return _run(sched, [Request(list(prompt), [sp], Collector())])[0][0], sched.stats

    first, _ = ask("cache")
    again, stats = ask("cache")
    assert_same(again, first)
    assert stats.accepted >= 12  # the stored answer, drafted and accepted
    assert_same(ask("none")[0], first)


def test_stops_inside_accepted_drafts(tiny_engine):
    """max_tokens and stop ids that fall inside a step's accepted drafts end the output where plain
    decoding ends it."""
    prompt = looping_prompts(2, 1)[0]
    for max_tokens in (3, 9, 17):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        plain, _ = run_one(tiny_engine, prompt, sp, "none")
        assert_same(run_one(tiny_engine, prompt, sp, "ngram")[0], plain, f"max_tokens {max_tokens}")
    long, _ = run_one(tiny_engine, prompt, SamplingParams(max_tokens=30, ignore_eos=True), "none")
    stop = SamplingParams(max_tokens=30, stop_ids=(long.output_ids[12],), ignore_eos=True)
    assert_same(run_one(tiny_engine, prompt, stop, "ngram")[0], run_one(tiny_engine, prompt, stop, "none")[0])


def test_stop_strings_inside_accepted_drafts(tiny_model_dir):
    """A stop string completed inside a step's accepted drafts (here an answer drafted from the cache)
    ends the text where plain decoding ends it (the real tokenizer: text, not ids)."""
    from jaxsmol.runtime.engine import Engine

    engine = Engine.load(tiny_model_dir, ctx=512, progress=False)
    cache, ids = PrefixCache(engine), np.random.default_rng(6).permutation(np.arange(300, 3000))[:24].tolist()
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    long = _run(verifying(Scheduler(cache, max_batch=1, speculate="cache")), [Request(ids, [sp], Collector())])[0][0]
    text = long.text
    word = max((text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)), key=text.find)  # first seen late
    stop = dataclasses.replace(sp, stop_strings=(word,))
    sched = verifying(Scheduler(cache, max_batch=1, speculate="cache"))
    spec = _run(sched, [Request(ids, [stop], Collector())])[0][0]
    plain = generate(engine, ids, stop, speculate="none")
    assert_same(spec, plain)
    assert spec.text == plain.text and spec.finish_reason == "stop"
    assert sched.stats.accepted > 0


def test_batch_equals_plain_decoding(tiny_engine):
    """Choices of several prompts in one continuous batch, each row drafting on its own."""
    cache = PrefixCache(tiny_engine, mode="off")
    prompts = looping_prompts(3, 3)
    sp = SamplingParams(max_tokens=30, temperature=0.3, seed=5, logprobs=1, ignore_eos=True)
    sched = verifying(Scheduler(cache, max_batch=8, speculate="ngram"))
    spec = generate_many(cache, prompts, sp, n=2, scheduler=sched)
    plain = generate_many(cache, prompts + [[5, 6]], sp, n=2)[:3]  # another width: its rows' bits are their own
    for xs, ys in zip(spec, plain):
        for x, y in zip(xs, ys):
            assert_same(x, y)
    assert sched.stats.accepted > 0 and sched.stats.drafted >= sched.stats.accepted


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a_rather_long_property_name", "flag"],
          "properties": {"a_rather_long_property_name": {"type": "integer"}, "flag": {"type": "boolean"}}}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_structured_output_jumps_forward(tiny_model_dir, temperature):
    """The tokens a JSON schema forces (its keys, braces) are drafted and verified in one step, each
    position under its own mask; the output equals plain decoding's."""
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.runtime.structured import canonical_spec

    engine = Engine.load(tiny_model_dir, ctx=512, progress=False)
    ids = engine.tokenizer.encode("Answer in JSON:")
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=3, logprobs=1,
                        structured=canonical_spec({"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    sched = verifying(Scheduler(PrefixCache(engine, mode="off"), max_batch=1, speculate="ngram"))
    spec = _run(sched, [Request(ids, [sp], Collector())])[0][0]
    assert_same(spec, generate(engine, ids, sp, speculate="none"))
    assert sched.stats.accepted >= 5  # the long key's tokens, at least


def test_bad_settings_are_named():
    with pytest.raises(JaxsmolError, match="speculate must be one of"):
        BatchSettings(speculate="draft-model")
    with pytest.raises(JaxsmolError, match="speculate_tokens must be in"):
        BatchSettings(speculate_tokens=0)


def test_ngram_needs_the_kernels(tiny_cfg):
    """Without the CPU kernels a verify step's rows are not a decode step's bits: ngram is refused, auto is off."""
    xla = dataclasses.replace(tiny_cfg, cpu_kernels=False)
    with pytest.raises(JaxsmolError, match="needs the CPU kernels"):
        speculating(BatchSettings(speculate="ngram"), xla)
    assert not speculating(BatchSettings(speculate="auto"), xla)
    assert speculating(BatchSettings(speculate="auto"), dataclasses.replace(tiny_cfg, cpu_kernels=True))


def test_ngram_drafts_follow_the_latest_occurrence():
    d = NgramDrafts([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3], most=3)
    assert d.draft(7) == [4, 5, 6]  # "1 2 3" last seen before 4 5 6 (not the earlier 9)
    assert d.draft(2) == [4, 5]
    assert NgramDrafts([1, 2, 3, 4], most=3).draft(3) == []  # nothing recurs


def test_speculator_verifies_only_where_it_pays():
    class Row:  # what the speculator reads of a decode row
        def __init__(self, chance):
            self.position, self.drafts, self.draft_source = 10, NgramDrafts([7, 8, 7], 7), "ngram"
            self.drafts.accepted, self.drafts.rejected = 1000 * chance, 1000 * (1 - chance)

        def draft(self, most, run_model=True):
            return [8, 7, 8, 7, 8, 7, 8][:most]

    s = Speculator()
    assert s.plan([Row(0.9)], 1, 64) is None  # no step timed yet: plain
    for shape, seconds in {(1, 1): 1.0, (1, 2): 1.1, (1, 4): 1.3, (1, 8): 1.8}.items():
        s.timed(*shape, seconds)
        s.timed(*shape, seconds)
    t, drafts = s.plan([Row(0.95)], 1, 64)
    assert t == 8 and drafts == [[8, 7, 8, 7, 8, 7, 8]]
    assert s.plan([Row(0.02)], 1, 64) is None  # rarely accepted: plain decoding is faster
    assert s.plan([Row(0.95)], 1, 13) is None or s.plan([Row(0.95)], 1, 13)[0] <= 3  # within the capacity
    assert expected(0.5, 2) == 0.75


def test_a_rows_chance_leans_on_its_sources_record():
    """A row with no record has its drafts' source's chance; verify steps move the row's and the source's."""
    s = Speculator()

    class Row:
        drafts, draft_source = NgramDrafts([], 3), "ngram"

    fresh, other = Row(), Row()
    other.drafts = NgramDrafts([], 3)
    assert s.chance(fresh) == 0.5
    for _ in range(20):
        s.verified(fresh, 3, 0)  # rejected every time
    assert s.chance(fresh) < 0.1
    assert s.chance(other) < 0.25  # a new row of the same source starts lower too
    other.draft_source = "grammar"
    assert s.chance(other) > 0.9


def test_a_verify_program_compiles_in_the_background(tiny_engine):
    """A verify step not yet compiled is not waited for: it compiles in a background thread (the batch
    decodes plainly meanwhile) and is ready afterwards."""
    import time

    from jaxsmol.cache.scheduler.compile_ahead import VerifyPrograms

    programs_ = VerifyPrograms(KVArena(tiny_engine, 3))  # an arena's shape no scheduler of this suite runs
    assert not programs_.ready(3, 4)
    deadline = time.monotonic() + 120
    while not programs_.ready(3, 4):
        assert time.monotonic() < deadline, "the background compile did not finish"
        time.sleep(0.05)


@pytest.mark.real
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_real_model_copy_equals_plain_decoding(real_engine, temperature):
    """The real model copying a passage after a one-shot example: its drafts are mostly accepted, and
    the tokens and logprobs are plain decoding's."""
    tok = real_engine.tokenizer
    passage = "The river runs north through the valley, past the old mill and the stone bridge, to the lake."
    text = tok.apply_chat_template([{"role": "user", "content": "Copy the text exactly.\nOriginal: The cat sat.\n"
                                     f"Copy: The cat sat.\nOriginal: {passage}\nCopy:"}])
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=7, logprobs=2)
    spec, stats = run_one(real_engine, tok.encode(text), sp, "auto")
    assert_same(spec, run_one(real_engine, tok.encode(text), sp, "none")[0])
    assert stats.accepted >= (10 if temperature == 0 else 3)  # sampling strays from the copy more often


def test_a_shape_timed_long_ago_is_timed_afresh():
    """A verify shape timed as slow (beside a compile, say) is tried again after RETIME_AFTER steps, and
    its new time replaces the old one."""
    from jaxsmol.cache.scheduler.speculation import RETIME_AFTER, StepTimes

    t = StepTimes()
    t.timed((1, 1), 0.5)  # a first run: compiling, not timed
    t.timed((1, 1), 1.0)
    t.timed((1, 8), 5.0)
    t.timed((1, 8), 9.0)
    assert t.estimate((1, 8), plain=1.0) == 9.0
    assert t.estimate((1, 8), plain=0.5) == 4.5  # a ratio to the plain step: the machine's speed moves both
    for _ in range(RETIME_AFTER + 1):
        t.timed((1, 1), 1.0)
    assert t.estimate((1, 8), plain=1.0) == pytest.approx(1.35)  # stale: a guess, so it is tried
    t.timed((1, 8), 2.0)
    assert t.estimate((1, 8), plain=1.0) == 2.0
