"""Speculation through the daemon (its default, --speculate auto): the token ids and logprobs of every
request, alone and under 8 concurrent clients, greedy and sampled, equal plain decoding's in the library
(`speculate="none"`), bit for bit; and /metrics counts the drafts by source. On the two-layer checkpoint
(its random weights loop on a repeating prompt, so drafts are accepted)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from daemon import Server, assert_healthy, metrics, post

C = "/v1/completions"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir):
    server = Server("--model", str(tiny_model_dir), "--max-batch", "8").wait_ready()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from jaxsmol.runtime.engine import Engine

    return Engine.load(tiny_model_dir, ctx=2048, progress=False)


def requests_(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(100, 20000, 8).tolist()
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        out.append({"prompt": base * 3 + base[:3], "max_tokens": 24, "logprobs": 2, "return_token_ids": True,
                    "ignore_eos": True, **sampled})
    return out


def plain(engine, body: dict) -> tuple:
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed", 0),
                        logprobs=2, ignore_eos=True)
    r = generate(engine, body["prompt"], sp, speculate="none")
    return r.output_ids, [p["logprob"] for p in r.logprobs]


def answer(url: str, body: dict) -> tuple:
    r = post(url, C, body, timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def accepted(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("jaxsmol_speculation_accepted_tokens_total"))


def answers_as_plain(url: str, engine, seed: int, least: int, most: int = 6) -> None:
    """Rounds of 8 concurrent requests and one alone (at least `least`, until the daemon has accepted drafts):
    every answer equals plain decoding's."""
    rounds = 0
    while rounds < least or accepted(url) == 0:
        assert rounds < most, "the daemon never accepted a draft"
        bodies = requests_(8, seed=seed + rounds)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: answer(url, b), bodies))
        for body, got in zip(bodies, answers):
            assert got == plain(engine, body), body
        alone = requests_(1, seed=seed + 100 + rounds)[0]
        assert answer(url, alone) == plain(engine, alone)
        rounds += 1


def test_speculating_daemon_answers_as_plain_decoding(daemon, engine):
    """Rounds of 8 concurrent requests and one alone, until the daemon has accepted drafts (its verify
    steps compile in the background at first): every answer equals plain decoding's."""
    answers_as_plain(daemon, engine, seed=0, least=2)
    m = metrics(daemon)
    for source in ("cache", "ngram", "grammar"):
        drafted = m[f'jaxsmol_speculation_drafted_tokens_total{{source="{source}"}}']
        assert 0 <= m[f'jaxsmol_speculation_accepted_tokens_total{{source="{source}"}}'] <= drafted
    assert m['jaxsmol_speculation_accepted_tokens_total{source="ngram"}'] > 0
    assert_healthy(daemon)


@pytest.fixture(scope="module")
def drafting_daemon(tiny_model_dir):
    server = Server("--model", str(tiny_model_dir), "--max-batch", "8", "--draft-model", str(tiny_model_dir))
    server.wait_ready()
    yield server.url
    server.stop()


def test_draft_model_daemon_answers_as_plain_decoding(drafting_daemon, engine):
    """--draft-model (its own weights here: greedy drafts nearly all accepted): 8 concurrent requests and
    one alone equal plain decoding's, and /metrics counts the draft model's drafts."""
    answers_as_plain(drafting_daemon, engine, seed=50, least=1)
    m = metrics(drafting_daemon)
    assert m['jaxsmol_speculation_accepted_tokens_total{source="draft"}'] > 0
    assert m["jaxsmol_batch_draft_cache_bytes"] > 0  # the prompts' draft states, stored
    assert post(drafting_daemon, "/v1/cache/flush", {}).status_code == 200
    assert metrics(drafting_daemon)["jaxsmol_batch_draft_cache_bytes"] == 0  # a flush forgets them too
    assert_healthy(drafting_daemon)
