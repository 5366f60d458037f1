"""A bfloat16 KV cache (--kv-dtype bfloat16): half the bytes a token, warm runs still equal cold runs
bit for bit within the dtype, a snapshot of the other dtype refused by name, and on the real model the
logprobs beside a float32 cache's."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsmol.cache import PrefixCache
from jaxsmol.cache.store.disk import load_prompt_cache, save_prompt_cache
from jaxsmol import Engine, JaxsmolError, SamplingParams, score
from jaxsmol.cache.scheduler.many import generate


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return {dt: Engine.load(tiny_model_dir, kv_dtype=dt, progress=False) for dt in ("float32", "bfloat16")}


def test_a_bfloat16_cache_takes_half_the_bytes(engines):
    f32, bf16 = engines["float32"], engines["bfloat16"]
    assert str(bf16.cache_dtype) == "bfloat16" and str(f32.cache_dtype) == "float32"
    assert 2 * bf16.kv_bytes_per_token == f32.kv_bytes_per_token
    assert bf16.fingerprint != f32.fingerprint  # their caches never mix


@pytest.mark.parametrize("mode", ["single", "radix"])
def test_warm_runs_equal_cold_runs_with_a_bfloat16_cache(engines, mode):
    engine = engines["bfloat16"]
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2)
    prompt = list(range(300, 420))
    cold = generate(engine, prompt, sp)
    cache = PrefixCache(engine, mode=mode)
    generate(cache, prompt[:90] + [5, 6], sp)
    warm = generate(cache, prompt, sp)
    report = warm.report
    assert warm.output_ids == cold.output_ids and report.reused >= 90
    assert warm.logprobs == cold.logprobs


def test_a_snapshot_of_the_other_kv_dtype_is_refused_by_name(engines, tmp_path):
    path = tmp_path / "prompt.snap"
    prompt = list(range(100, 150))
    f32 = PrefixCache(engines["float32"], mode="single")
    generate(f32, prompt, SamplingParams(max_tokens=1))
    assert save_prompt_cache(f32, path, prompt) > 0
    report = load_prompt_cache(PrefixCache(engines["bfloat16"], mode="single"), path, prompt)
    assert report.refused and "holds a float32 KV cache; this engine's is bfloat16 (--kv-dtype)" in report.refused


def test_a_bad_kv_dtype_is_named(tiny_model_dir):
    with pytest.raises(JaxsmolError, match="kv_dtype must be float32 or bfloat16, got 'float16'"):
        Engine.load(tiny_model_dir, kv_dtype="float16", progress=False)


@pytest.mark.real
def test_bfloat16_kv_stays_close_to_float32_kv(real_engine, model_dir):
    bf16 = Engine.load(model_dir, kv_dtype="bfloat16", progress=False)
    prompts = ["The capital of France is Paris. The capital of Germany is Berlin.",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
               "Once upon a time, in a small village by the sea, there lived an old fisherman."]
    lp = lambda e, p: [s.logprob for s in score(e, e.tokenizer.encode(p))[1:]]  # noqa: E731
    diff = np.concatenate([np.abs(np.array(lp(bf16, p)) - np.array(lp(real_engine, p))) for p in prompts])
    print(f"bfloat16 KV vs float32 KV: max |logprob diff| {diff.max():.4f}, mean {diff.mean():.5f} over {diff.size}")
    assert diff.max() < 0.05 and diff.mean() < 0.01
    sp = SamplingParams(max_tokens=16)
    ids = real_engine.tokenizer.encode(prompts[2])
    assert generate(bf16, ids, sp).text == generate(real_engine, ids, sp).text
