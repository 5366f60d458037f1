"""The engine (jaxsmol/runtime/engine.py) on the real default model, SmolLM2-135M-Instruct: a chat answer,
prefill then decode versus one forward, chunked prefill versus one shot. The same on the tiny random
model is in tests/test_engine.py and tests/test_model.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsmol.runtime.chunks import chunk_plan
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

TEXT = ("The history of the city begins with a small fishing village on the banks of a wide river. Over the "
        "centuries, merchants arrived from distant lands, bringing spices, silk and new ideas. Bridges were "
        "built, markets grew, and scholars founded a university whose library became famous across the "
        "continent. ")


@pytest.mark.real
def test_real_chat_capital_of_france(real_engine):
    tok = real_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    gen = generate(real_engine, prompt, SamplingParams(max_tokens=12))
    assert gen.text.startswith("The capital of France is Paris."), gen.text


@pytest.mark.real
def test_real_prefill_then_decode_equals_one_forward(real_engine):
    ids = real_engine.tokenizer.encode(TEXT)[:45]
    assert len(ids) == 45
    ref = real_engine.logits_all(ids)
    kv = real_engine.new_cache(64)
    logits, kv = real_engine.prefill(ids[:40], kv)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[39], atol=1e-4)
    for j in range(40, 45):
        logits, kv = real_engine.decode(ids[j], kv)
        np.testing.assert_allclose(np.asarray(logits[0]), ref[j], atol=1e-4, err_msg=f"position {j}")


@pytest.mark.real
def test_real_chunked_prefill_equals_one_shot(real_engine):
    """300 tokens as a 256-token chunk then a 64-token chunk (how a prefix hit continues) versus one
    forward over all 300 (logits and cache contents)."""
    ids = real_engine.tokenizer.encode(TEXT * 6)[:300]
    assert len(ids) == 300
    assert chunk_plan(300) == [512]  # so this prefill is one forward over all 300 (padded to 512)
    ref, ref_kv = real_engine.prefill(ids, real_engine.new_cache(512))
    kv = real_engine.new_cache(512)
    _, kv = real_engine.prefill(ids[:256], kv)
    logits, kv = real_engine.prefill(ids, kv)  # continues at kv.pos == 256
    assert int(kv.pos) == int(ref_kv.pos) == 300
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(kv.k[:, :, :, :300]), np.asarray(ref_kv.k[:, :, :, :300]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(kv.v[:, :, :, :300]), np.asarray(ref_kv.v[:, :, :, :300]), atol=1e-4)
