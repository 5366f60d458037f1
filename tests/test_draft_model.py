"""A draft model (`speculate="draft"`, `--draft-model`) changes nothing but speed: the token ids, logprobs and
finish reasons equal plain decoding's bit for bit, whatever the draft proposes (the target's own weights,
whose greedy drafts are nearly all accepted, or other random weights, whose are nearly all rejected),
alone and in a batch; a row's draft cache follows what the target accepted, is stored in and restored from
the draft's prefix cache, and catches up after steps that did not draft; mismatched models and settings
are refused by name."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.draft_model import DRAFT_STEPS, DraftModel
from jaxsmol.cache.scheduler.many import _run, generate, generate_many
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cli.common import check_speculate, load_draft
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.config import Config
from jaxsmol.model.params import init_random
from jaxsmol.runtime.engine import Engine
from jaxsmol.runtime.sampling import SamplingParams

from test_speculation import assert_same, looping_prompts, verifying


@pytest.fixture(scope="module")
def other_engine(tiny_cfg):
    """The tiny config with other random weights: a draft whose proposals the target rarely accepts."""
    engine = Engine(tiny_cfg, init_random(tiny_cfg, seed=5), None, ctx=1024)
    engine._fingerprint = "tiny-other"
    return engine


def drafting(cache: PrefixCache, draft, max_batch: int = 1) -> Scheduler:
    return verifying(Scheduler(cache, draft, max_batch=max_batch, speculate="draft"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_alone_equals_plain_decoding(tiny_engine, other_engine, temperature):
    prompt = np.random.default_rng(1).integers(3, 256, 30).tolist()
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=3, logprobs=2, ignore_eos=True)
    plain = generate(tiny_engine, prompt, sp, speculate="none")
    for draft in (tiny_engine, other_engine):
        sched = drafting(PrefixCache(tiny_engine), draft)
        result = _run(sched, [Request(list(prompt), [sp], Collector(), detail=True)])[0][0]
        assert_same(result, plain, f"draft {draft._fingerprint}")
        assert sched.stats.by_source["draft"][0] > 0
        if draft is tiny_engine and temperature == 0:  # its own weights: the drafts are its greedy tokens
            drafted, accepted = sched.stats.by_source["draft"]
            assert accepted >= 0.8 * drafted


def test_batch_equals_plain_decoding(tiny_engine):
    """Three prompts x n=2 sampled, drafting side by side (each row its own draft cache), at width 8."""
    prompts, sp = looping_prompts(7, 3), SamplingParams(max_tokens=24, temperature=0.8, seed=11, logprobs=1)
    plain = generate_many(PrefixCache(tiny_engine, mode="off"), prompts, sp, n=2, speculate="none")
    sched = drafting(PrefixCache(tiny_engine, mode="off"), tiny_engine, max_batch=8)
    spec = generate_many(sched.cache, prompts, sp, n=2, scheduler=sched)
    for a, b in zip(spec, plain):
        for x, y in zip(a, b):
            assert_same(x, y)
    assert sched.stats.by_source["draft"][1] > 0


def test_recurring_ngrams_are_drafted_first(tiny_engine, other_engine):
    """Where the row's n-grams recur (a looping prompt, greedy), their drafts come before the draft
    model's: accepted here where the other weights' drafts are not; the output is plain decoding's."""
    prompt, sp = looping_prompts(2, 1)[0], SamplingParams(max_tokens=40, logprobs=1, ignore_eos=True)
    sched = drafting(PrefixCache(tiny_engine, mode="off"), other_engine)
    result = _run(sched, [Request(list(prompt), [sp], Collector())])[0][0]
    assert_same(result, generate(tiny_engine, prompt, sp, speculate="none"))
    assert sched.stats.by_source["ngram"][1] > 0


def test_the_draft_cache_is_stored_and_restored(tiny_engine):
    """The prompt's draft state is stored in the draft's prefix cache and restored for the same prompt
    asked again (one draft cache for the schedulers of one target cache, as the daemon keeps it)."""
    cache = PrefixCache(tiny_engine, save_generated=False)  # no answer stored: nothing drafted from the cache
    draft = DraftModel(tiny_engine, cache)
    prompt = np.random.default_rng(3).permutation(np.arange(3, 256))[:30].tolist()  # no n-gram recurs
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    first = _run(drafting(cache, draft), [Request(list(prompt), [sp], Collector())])[0][0]
    assert draft.cache.stats.saves == 1 and draft.cache.stats.hits == 0
    again = _run(drafting(cache, draft), [Request(list(prompt), [sp], Collector())])[0][0]
    assert draft.cache.stats.hits == 1 and draft.cache.stats.tokens_reused == len(prompt)
    assert_same(again, first)
    assert draft.cache.budget_bytes == cache.budget_bytes  # the same model: as many positions as the target's


def test_a_row_catches_up_after_steps_without_drafts(tiny_engine):
    """A draft cache that missed plain steps takes their tokens in before drafting: its drafts are then the
    greedy continuation, as a draft made afresh from the whole sequence gives them."""
    cache = PrefixCache(tiny_engine, mode="off")
    prompt = np.random.default_rng(2).integers(3, 256, 20).tolist()
    greedy = generate(tiny_engine, prompt, SamplingParams(max_tokens=16, ignore_eos=True), speculate="none").output_ids
    lk, model = cache.lookup(prompt, 16), DraftModel(tiny_engine, cache)
    row = model.drafts(lk, 16)
    row.sync(greedy[:1], len(prompt))
    assert row.draft(3) == greedy[1:4]
    row.verified(3, 1)  # one accepted: the draft cache keeps the first draft's state
    row.sync(greedy[:9], len(prompt))  # then plain steps: 6 tokens it has not seen
    assert row.draft(3) == greedy[9:12]
    fresh = model.drafts(lk, 16)
    fresh.sync(greedy[:9], len(prompt))
    assert fresh.draft(3) == greedy[9:12]


def test_a_prompt_past_the_drafts_context_decodes_plainly(tiny_cfg, tiny_engine):
    short = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=64)
    short._fingerprint = "tiny-short"
    prompt, sp = looping_prompts(5, 1)[0] * 3, SamplingParams(max_tokens=40, ignore_eos=True)
    sched = drafting(PrefixCache(tiny_engine, mode="off"), short)
    result = _run(sched, [Request(list(prompt), [sp], Collector())])[0][0]
    assert_same(result, generate(tiny_engine, prompt, sp, speculate="none"))
    assert sched.stats.by_source.get("draft", [0])[0] == 0 and sched.stats.drafted > 0  # n-gram drafts only


def test_mismatches_are_refused_by_name(tiny_engine):
    cfg = Config.tiny(vocab_size=300)
    other_vocab = Engine(cfg, init_random(cfg), None)
    with pytest.raises(JaxsmolError, match="vocabulary"):
        Scheduler(PrefixCache(tiny_engine, mode="off"), other_vocab, speculate="draft")
    with pytest.raises(JaxsmolError, match="needs a draft model"):
        Scheduler(PrefixCache(tiny_engine, mode="off"), speculate="draft")
    with pytest.raises(JaxsmolError, match="draft or auto, not ngram"):
        Scheduler(PrefixCache(tiny_engine, mode="off"), tiny_engine, speculate="ngram")
    with pytest.raises(JaxsmolError, match="needs --draft-model"):
        check_speculate(argparse.Namespace(speculate="draft", draft_model=None))
    with pytest.raises(JaxsmolError, match="--draft-model drafts only with"):
        check_speculate(argparse.Namespace(speculate="none", draft_model="x"))


def test_the_daemons_warm_up_compiles_the_drafts_programs(tiny_engine):
    """scheduler_calls (what the daemon compiles before it is ready) holds the draft model's prompt chunks
    and draft calls: a drafting request afterwards compiles no draft program."""
    from jaxsmol.cache.scheduler.compile_ahead import scheduler_calls
    from jaxsmol.runtime import programs

    cache = PrefixCache(tiny_engine, mode="off")
    sched = drafting(cache, tiny_engine)
    calls = scheduler_calls(sched)
    assert sum(program is programs.greedy_drafts for program, _, _ in calls) == len(DRAFT_STEPS)  # one arena
    programs.compile_all(calls)
    held = programs.compiled_count("greedy_drafts")
    prompt, sp = np.random.default_rng(9).integers(3, 256, 30).tolist(), SamplingParams(max_tokens=40)
    _run(sched, [Request(prompt, [sp], Collector())])
    assert sched.stats.by_source["draft"][0] > 0
    assert programs.compiled_count("greedy_drafts") == held


def test_a_draft_model_that_cannot_load_is_named(tiny_engine, tmp_path):
    args = argparse.Namespace(draft_model=str(tmp_path / "missing"), dtype="float32")
    with pytest.raises(JaxsmolError, match=r"--draft-model .*missing: model directory .* does not exist"):
        load_draft(args, tiny_engine)
