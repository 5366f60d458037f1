"""THE property of the prefix cache: a warm run gives the bits of a cold run.

For random prompts, split points and request sequences on the tiny config, every request is run
through prefix caches (radix and single, exact=True) that have seen the earlier requests, and cold
on the bare engine; the last prompt position's logits, the generated ids and the reported
log-probabilities must be equal bit for bit. Then the same on the real model.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.model.config import Config
from jaxsmol.runtime.engine import Engine
from jaxsmol.model.params import init_random
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

GREEDY = SamplingParams(max_tokens=3, logprobs=3)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, logprobs=3, temperature=0.9, top_k=40, top_p=0.95, seed=seed)


# No shrinking: a failure's message names the prompt length, split and mode; shrinking a failure
# here would cost minutes of forwards on a shared machine.
SETTINGS = settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def uniform(lo: int, hi: int):
    """An integer drawn uniformly from [lo, hi] (st.integers favours small values and boundaries)."""
    return st.sampled_from(range(lo, hi + 1))


def assert_bitwise(gen, cold, what=""):
    assert np.array_equal(gen.prompt_logits, cold.prompt_logits), f"prompt logits differ {what}"
    assert gen.output_ids == cold.output_ids, what
    assert gen.logprobs == cold.logprobs, what
    assert gen.finish_reason == cold.finish_reason, what


class Cold:
    """Cold runs of the bare engine, memoized per (prompt, sampling)."""

    def __init__(self, engine):
        self.engine, self.memo = engine, {}

    def __call__(self, prompt, sp):
        key = (tuple(prompt), sp)
        if key not in self.memo:
            self.memo[key] = generate(self.engine, prompt, sp)
        return self.memo[key]


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(scope="module")
def engines(tiny_engine):
    """The tiny config (4 query heads, 2 kv heads), and the same with the real model's head layout
    (SmolLM2-135M: 9 query heads over 3 kv heads): XLA:CPU compiles the attention differently for
    it, so bit-exactness has to hold for that layout too, not only for the convenient one."""
    cfg = Config.tiny(n_heads=9, n_kv_heads=3)
    gqa93 = Engine(cfg, init_random(cfg), None, ctx=1024)
    gqa93._fingerprint = "tiny-9:3"
    return {"tiny": tiny_engine, "tiny-9:3": gqa93}


ENGINES = ["tiny", "tiny-9:3"]


# ---- split points ----------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ENGINES)
@pytest.mark.parametrize("split", [1, 2, 63, 64, 65, 128, 255, 256, 257, 300, 399])
def test_split_points_at_chunk_and_block_boundaries(engines, which, split):
    """The cache has seen the prompt's first `split` tokens followed by something else."""
    eng = engines[which]
    vocab = eng.cfg.vocab_size
    cold = Cold(eng)
    prompt = tokens(1, 400, vocab)
    seen = prompt[:split] + tokens(2, 30, vocab)
    seen[split] = (prompt[split] + 1) % vocab
    for mode in ("radix", "single"):
        cache = PrefixCache(eng, mode=mode, save_generated=False)
        generate(cache, seen, GREEDY)
        gen = generate(cache, prompt, GREEDY)
        r = gen.report
        assert r.reused == split
        assert_bitwise(gen, cold(prompt, GREEDY), f"{mode} split={split}")


@SETTINGS
@given(data=st.data())
def test_random_split_points(engines, data):
    eng = engines[data.draw(st.sampled_from(ENGINES), label="engine")]
    vocab = eng.cfg.vocab_size
    n = data.draw(uniform(2, 400), label="prompt length")
    split = data.draw(uniform(1, n), label="split")
    extra = data.draw(st.integers(0, 40), label="tokens after the split in the stored sequence")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    sp = data.draw(st.sampled_from([GREEDY, sampled(seed % 1000)]), label="sampling")
    prompt = tokens(seed, n, vocab)
    seen = prompt[:split] + tokens(seed + 1, extra, vocab)
    if extra and split < n:
        seen[split] = (prompt[split] + 1) % vocab  # diverge exactly at the split
    cold = Cold(eng)(prompt, sp)
    for mode in ("radix", "single"):
        cache = PrefixCache(eng, mode=mode)
        generate(cache, seen, sp)
        gen = generate(cache, prompt, sp)
        r = gen.report
        assert r.reused == gen.timings.reused_tokens
        assert_bitwise(gen, cold, f"{mode} n={n} split={split} extra={extra}")


# ---- random request sequences -----------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_random_request_sequences(engines, data):
    """Each request's prompt is drawn from the earlier prompts and prompts + answers (chat turns):
    an exact repeat, an extension by new tokens, or a random cut of one (0: fresh tokens) followed by
    new tokens. Both caches see all the requests, in order; each must equal its cold run."""
    eng = engines[data.draw(st.sampled_from(ENGINES), label="engine")]
    vocab = eng.cfg.vocab_size
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    cold = Cold(eng)
    caches = {mode: PrefixCache(eng, mode=mode) for mode in ("radix", "single")}
    pool = [tokens(seed, data.draw(uniform(2, 400), label="base length"), vocab)]
    for i in range(data.draw(st.integers(2, 5), label="requests")):
        src = pool[data.draw(st.integers(0, len(pool) - 1), label="source")]
        kind = data.draw(st.sampled_from(["repeat", "cut", "extend"]), label="kind")
        cut = {"repeat": len(src), "extend": len(src)}.get(kind) or data.draw(uniform(0, len(src)), label="cut")
        new = 0 if kind == "repeat" else data.draw(st.integers(max(0, 2 - cut), 60), label="new tokens")
        prompt = (src[:cut] + [int(x) for x in rng.integers(0, vocab, new)])[:400]
        sp = data.draw(st.sampled_from([GREEDY, sampled(int(rng.integers(1000)))]), label="sampling")
        reference = cold(prompt, sp)
        for mode, cache in caches.items():
            gen = generate(cache, prompt, sp)
            r = gen.report
            assert r.reused == gen.timings.reused_tokens
            assert_bitwise(gen, reference, f"request {i} ({mode}, n={len(prompt)}, reused={r.reused})")
            event(f"{mode}: {'exact hit' if r.exact_hit else 'partial hit' if r.reused else 'miss'}")
        pool.append(prompt)
        pool.append(prompt + reference.output_ids)


# ---- multi-turn ------------------------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_multi_turn_reuses_the_saved_answer_bitwise(engines, data):
    """turn k+1 = turn k's prompt + its answer + new tokens: reused from the generated save (radix),
    bit for bit equal to cold; regenerating at the end of an answer is an exact hit, equal too."""
    eng = engines[data.draw(st.sampled_from(ENGINES), label="engine")]
    vocab = eng.cfg.vocab_size
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    n = data.draw(uniform(2, 300), label="turn-1 length")
    sp = data.draw(st.sampled_from([GREEDY, sampled(seed % 1000)]), label="sampling")
    cold = Cold(eng)
    cache = PrefixCache(eng, mode="radix")
    single = PrefixCache(eng, mode="single")
    prompt = tokens(seed, n, vocab)
    previous_answer_end = 0  # len(prompt + answer) of the previous turn; checked from turn 1 on
    for turn in range(3):
        gen = generate(cache, prompt, sp)
        r = gen.report
        reference = cold(prompt, sp)
        assert_bitwise(gen, reference, f"turn {turn} radix")
        gm = generate(single, prompt, sp)
        assert_bitwise(gm, reference, f"turn {turn} single")
        if turn:
            assert r.reused >= previous_answer_end, "the previous answer was not reused"
        answer = prompt + gen.output_ids
        if gen.output_ids:
            again = generate(cache, answer, sp)  # the same conversation, at the end of the answer
            ra = again.report
            assert ra.exact_hit
            assert_bitwise(again, cold(answer, sp), f"turn {turn} regenerate")
        previous_answer_end = len(answer)
        new = data.draw(st.integers(1, 40), label="new tokens")
        prompt = answer + tokens(seed + turn + 1, new, vocab)
        if len(prompt) + sp.max_tokens > eng.ctx:
            break


# ---- the real model -------------------------------------------------------------------------------

@pytest.mark.real
def test_real_model_split_points_and_chat_continuation(real_engine):
    eng = real_engine
    tok = eng.tokenizer
    cold = Cold(eng)
    text = " ".join(f"Item {i}: the {w} jumps over the {v}." for i, (w, v) in
                    enumerate(zip(["fox", "cat", "dog", "owl", "elk"] * 8, ["moon", "fence", "log", "river"] * 10)))
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Summarize this list in one sentence.\n" + text}]
    prompt = tok.encode(tok.apply_chat_template(messages))[:300]
    assert len(prompt) >= 250
    sp = SamplingParams(max_tokens=3, logprobs=3)
    reference = cold(prompt, sp)
    for split in (37, 128, 257):
        seen = prompt[:split] + tok.encode(" something else entirely, and then more words")
        for mode in ("radix", "single"):
            cache = PrefixCache(eng, mode=mode, save_generated=False)
            generate(cache, seen, sp)
            gen = generate(cache, prompt, sp)
            r = gen.report
            assert r.reused >= split  # (more if the seen suffix happens to continue like the prompt)
            assert_bitwise(gen, reference, f"real {mode} split={split}")
    # a chat continuation: the answer is saved (re-prefilled exactly) and reused by the next turn
    cache = PrefixCache(eng, mode="radix")
    gen = generate(cache, prompt, sp)
    assert_bitwise(gen, reference, "real turn 1")
    turn2 = prompt + gen.output_ids + tok.encode("<|im_end|>\n<|im_start|>user\nThanks! And shorter?<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
    gen2 = generate(cache, turn2, sp)
    r2 = gen2.report
    assert r2.reused == len(prompt) + len(gen.output_ids)
    assert_bitwise(gen2, cold(turn2, sp), "real turn 2")
