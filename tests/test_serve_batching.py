"""Continuous batching in the daemon (cli/server/worker.py driving cache/scheduler/scheduler.py), on real daemons.

* `invariant` — `--batch-invariant --max-batch 4`: a request's tokens and logprobs are the same alone
  or among other requests, and n samples of one prompt prefill it once;
* the default daemon's batching (many clients at once, answered exactly once) is in test_serve.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

import pytest

from daemon import Server, assert_healthy, metrics, post

pytestmark = pytest.mark.real

C = "/v1/completions"


@pytest.fixture(scope="module")
def invariant():
    server = Server("--batch-invariant", "--max-batch", "4").wait_ready()
    yield server.url
    server.stop()


def _body(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2, "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex, **kw}


def _choice(r) -> tuple:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"], c["text"]


def test_a_request_alone_equals_it_among_others(invariant):
    """Same tokens, same logprobs (exact floats), whether it ran alone or beside five other requests
    of other lengths and sampling settings that join and leave the batch meanwhile."""
    target = _body("The three primary colours are")
    alone = _choice(post(invariant, C, target))
    others = [_body(f"Story {i}: " + "once upon a time " * (5 * i), max_tokens=4 + 5 * i, temperature=0.8,
                    seed=i, top_p=0.9) for i in range(5)]
    barrier = threading.Barrier(6)

    def send(body):
        barrier.wait(timeout=60)
        return post(invariant, C, body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(send, b) for b in others[:3] + [target] + others[3:]]
        answers = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert _choice(answers[3]) == alone
    assert_healthy(invariant)


def test_n_samples_prefill_the_prompt_once(invariant):
    prompt = "Here is a question that many samples will answer. " * 6 + "What is the best season?"
    before = metrics(invariant)["jaxsmol_batch_prefilled_tokens_total"]
    r = post(invariant, C, _body(prompt, n=4, temperature=0.9, seed=5, logprobs=None))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = metrics(invariant)["jaxsmol_batch_prefilled_tokens_total"]
    assert after - before == usage["prompt_tokens"]  # once, not 4 times
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # cold, for every choice
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 4 and len(set(texts)) > 1  # seeds seed + i: different samples
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]


def test_batch_metrics(invariant):
    m = metrics(invariant)
    assert m["jaxsmol_batch_width"] == 4  # batch-invariant: always the full width once started
    assert m["jaxsmol_batch_rows"] == 0 and m["jaxsmol_batch_pending"] == 0
    assert m["jaxsmol_batch_steps_total"] > 0 and m["jaxsmol_batch_decoded_tokens_total"] > 0
    assert 0 < m["jaxsmol_batch_kv_bytes"] <= 4 << 30
