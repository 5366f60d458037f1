"""End-to-end tests of `jaxsmol serve` (cli/server/serve.py, cli/server/completions.py, cli/server/worker.py,
cli/server/metrics.py, cli/client.py, cli/aitest.py): the endpoints, the prefix cache over HTTP, concurrency,
metrics and the aitest client.
Bad requests are in tests/test_serve_bad_requests.py, a client that leaves, a full queue and SIGTERM in
tests/test_serve_admission.py, the OpenAI API in depth and tenants in tests/test_openai_api.py.

Every test talks to a REAL server process (`python -m jaxsmol.cli.main serve`) over loopback, mostly through
the official `openai` client, else through httpx. The daemons are shared by tests/test_serve*.py
(fixtures in conftest; they start two at a time, so that their start-ups overlap, and stop when the run
moves on to other tests). They serve the two-layer checkpoint with the real tokenizer (conftest's
`tiny_model_dir`): these tests check the daemon, not the weights; the real model is served in
tests/test_openai_api.py, test_serve_batching.py, test_soak.py and test_sharding.py.

* `server`          — the default daemon (prefix cache on, --max-queue 64), ctx 2048;
* `nocache_server`  — the same with --no-prefix-cache: the reference every cached answer must equal;
* `queue_server`    — --max-queue 1, for the 503 + Retry-After path;
* `sigterm_server`  — a throw-away daemon the SIGTERM test stops.

Tests that depend on the prefix cache use a fresh `cache_salt` so that the shared cache (and the flush
test) cannot change what they see.
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest

import httpx  # noqa: E402  (test extra)
from daemon import CTX, ROOT
from daemon import assert_healthy as _assert_healthy
from daemon import client as _client
from daemon import complete as _complete
from daemon import metrics as _metrics
from daemon import post as _post

pytestmark = pytest.mark.real

# ~290 tokens of text shared by the prefix-cache requests, then different endings
PREFIX = "Here is a list of facts. " + " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(18))
SHORT_PREFIX = PREFIX[:400]  # ~100 tokens: enough for the salt / bypass / flush checks, cheaper to prefill
ENDINGS = (" Question: what is fact 3? Answer:", " Question: what is fact 11? Answer:")


@pytest.fixture(scope="module")
def tokenizer():
    from jaxsmol.checkpoint.default_model import default_model_dir
    from jaxsmol.checkpoint.tokenizer import Tokenizer

    return Tokenizer.load(default_model_dir(progress=False))


def _ids(choice) -> list[int]:
    ids = (choice.model_extra or {}).get("token_ids")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), choice
    return ids


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


# ---- basic endpoints ----------------------------------------------------------------------------------
def test_health_and_models(server):
    _assert_healthy(server)
    models = _client(server).models.list().data
    assert len(models) == 1
    assert models[0].id and models[0].object == "model"
    assert models[0].model_extra.get("max_model_len") == CTX


# what docs/design.md says a daemon at --max-batch 16 makes ready before it is ready, on a model the kernels
# run: one prompt's chunks of 8-128 rows (5), 2, 4 and 8 prompts side by side at 8, 16 and 32 rows (9),
# decode steps at widths 1, 2, 4, 8, 16 (5), first tokens of 1 and of 16 choices (2), verify steps at 4
# and 8 positions of each width (10), a scoring chunk (1), a restore's, a fork's and a save's copies (3)
PROGRAMS_AHEAD = 5 + 9 + 5 + 2 + 10 + 1 + 3


def test_the_programs_made_before_ready_are_the_closed_set(server, serve_daemons):
    """Before it says ready the daemon makes every program its requests can run, PROGRAMS_AHEAD of them
    (Scheduler.compile_programs; tests/test_closed_programs.py checks that requests of any fields then
    make none), says so on stderr, and /health says it is no longer compiling."""
    main = serve_daemons.servers["main"]
    deadline = time.monotonic() + 600
    while not (found := re.search(r"programs ready ahead: (\d+) in", main.output(None))):
        assert time.monotonic() < deadline and main.proc.poll() is None, main.output()
        time.sleep(0.5)
    assert int(found.group(1)) == PROGRAMS_AHEAD
    assert httpx.get(server + "/health", timeout=30).json()["compiling"] is False


def test_completion_text_and_token_id_prompts(server, tokenizer):
    text = "The capital of France is"
    by_text = _complete(server, text, max_tokens=6)
    assert by_text.object == "text_completion" and len(by_text.choices) == 1
    choice = by_text.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("length", "stop")
    assert isinstance(choice.text, str) and choice.text
    ids = tokenizer.encode(text)
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == len(_ids(choice)) <= 6
    assert by_text.usage.total_tokens == by_text.usage.prompt_tokens + by_text.usage.completion_tokens
    assert tokenizer.decode(_ids(choice)) == choice.text

    by_ids = _complete(server, ids, max_tokens=6)
    assert by_ids.choices[0].text == choice.text
    assert _ids(by_ids.choices[0]) == _ids(choice)
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_completion(server):
    resp = _client(server).chat.completions.create(
        model="m", messages=[{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "Name one colour."}], max_tokens=8, temperature=0)
    assert resp.object == "chat.completion" and len(resp.choices) == 1
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert 0 < resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 10
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_equals_non_streamed(server):
    client = _client(server)
    kw = dict(model="m", prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    text, finish, usage, n_chunks = "", None, None, 0
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        n_chunks += 1
        for c in chunk.choices:
            assert c.index == 0
            text += c.text
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    assert n_chunks > 2  # streamed token by token, not one blob
    assert text == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed(server):
    client = _client(server)
    kw = dict(model="m", messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=12,
              temperature=0)
    full = client.chat.completions.create(**kw)
    text, roles, finish = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"]  # once, on the first delta
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason


def test_n_choices_with_seed(server):
    client = _client(server)
    kw = dict(model="m", prompt="My favourite animal is the", max_tokens=8, temperature=0.9, seed=1234,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw, n=3)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.completion_tokens == sum(len(_ids(c)) for c in a.choices)
    b = client.completions.create(**kw, n=3)  # the same seed: the same three samples
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [_ids(c) for c in a.choices] == [_ids(c) for c in b.choices]
    # choice i is sampled with seed + i
    single = client.completions.create(**{**kw, "seed": 1235})
    assert _ids(single.choices[0]) == _ids(a.choices[1])


def test_completion_logprobs(server):
    resp = _complete(server, "The quick brown fox", max_tokens=4, logprobs=3)
    choice = resp.choices[0]
    lp = choice.logprobs
    n = len(_ids(choice))
    assert n == resp.usage.completion_tokens > 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # distinct ids can decode to the same string
        assert logprob <= 0 and all(v <= 0 for v in top.values())
        # greedy: the chosen token is the most likely one
        assert token in top and logprob == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(server):
    resp = _client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens > 0
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


# ---- the prefix cache ---------------------------------------------------------------------------------
def test_prefix_cache_reuse_equals_uncached_server(server, nocache_server, tokenizer):
    salt = uuid.uuid4().hex
    n_prefix = len(tokenizer.encode(PREFIX))
    assert 250 <= n_prefix <= 400
    first = _complete(server, PREFIX + ENDINGS[0], salt=salt, max_tokens=8)
    second = _complete(server, PREFIX + ENDINGS[1], salt=salt, max_tokens=8)
    assert _cached(first) == 0
    assert n_prefix - 2 <= _cached(second) < second.usage.prompt_tokens
    again = _complete(server, PREFIX + ENDINGS[1], salt=salt, max_tokens=8)  # the same prompt: fully cached
    assert _cached(again) >= again.usage.prompt_tokens - 1
    for resp, ending in ((first, ENDINGS[0]), (second, ENDINGS[1]), (again, ENDINGS[1])):
        ref = _complete(nocache_server, PREFIX + ending, salt=salt, max_tokens=8)
        assert _cached(ref) == 0
        assert resp.usage.prompt_tokens == ref.usage.prompt_tokens
        assert resp.choices[0].text == ref.choices[0].text
        assert _ids(resp.choices[0]) == _ids(ref.choices[0])
        assert resp.choices[0].finish_reason == ref.choices[0].finish_reason


def test_chat_prefix_cache_equals_uncached_server(server, nocache_server):
    salt = uuid.uuid4().hex
    system = {"role": "system", "content": PREFIX}

    def ask(url, question):
        return _client(url).chat.completions.create(
            model="m", messages=[system, {"role": "user", "content": question}], max_tokens=6, temperature=0,
            extra_body={"cache_salt": salt, "return_token_ids": True})
    ask(server, "What is fact 2?")
    warm = ask(server, "What is fact 5?")
    assert _cached(warm) > 250
    ref = ask(nocache_server, "What is fact 5?")
    assert _cached(ref) == 0
    assert warm.choices[0].message.content == ref.choices[0].message.content
    assert _ids(warm.choices[0]) == _ids(ref.choices[0])


def test_cache_salt_isolates_tenants(server):
    salt_a, salt_b = uuid.uuid4().hex, uuid.uuid4().hex
    prompt = SHORT_PREFIX + ENDINGS[0]
    a1 = _complete(server, prompt, salt=salt_a)
    a2 = _complete(server, prompt, salt=salt_a)
    b1 = _complete(server, prompt, salt=salt_b)
    assert _cached(a1) == 0 and _cached(a2) > 0
    assert _cached(b1) == 0  # another tenant does not see salt_a's entries
    assert _ids(a1.choices[0]) == _ids(a2.choices[0]) == _ids(b1.choices[0])


def test_use_prefix_cache_false_bypasses(server):
    salt = uuid.uuid4().hex
    prompt = SHORT_PREFIX + ENDINGS[1]
    warm_up = _complete(server, prompt, salt=salt)
    assert _cached(_complete(server, prompt, salt=salt)) > 0
    bypass = _complete(server, prompt, salt=salt, use_prefix_cache=False)
    assert _cached(bypass) == 0
    assert _ids(bypass.choices[0]) == _ids(warm_up.choices[0])


def test_cache_flush(server):
    salt = uuid.uuid4().hex
    prompt = SHORT_PREFIX + ENDINGS[0]
    _complete(server, prompt, salt=salt)
    assert _cached(_complete(server, prompt, salt=salt)) > 0
    assert _metrics(server)["jaxsmol_cache_bytes"] > 0
    r = httpx.post(server + "/v1/cache/flush", timeout=60)
    assert r.status_code == 200 and r.json() == {"flushed": True}
    assert _metrics(server)["jaxsmol_cache_bytes"] == 0
    assert _cached(_complete(server, prompt, salt=salt)) == 0


# ---- concurrency --------------------------------------------------------------------------------------
def test_32_concurrent_clients_match_sequential(server, nocache_server):
    n = 32
    prompts = [f"Request {i}: the number {i} written in words is" for i in range(n)]

    def body(i, salt):
        b = {"prompt": prompts[i], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        return b if salt is None else {**b, "cache_salt": salt}

    salt = uuid.uuid4().hex
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait(timeout=60)
        return _post(server, "/v1/completions", body(i, salt), timeout=300)

    # meanwhile the same requests go one by one to the reference server (its own process, so the two
    # runs overlap in time without touching each other)
    def one_by_one():
        return [_post(nocache_server, "/v1/completions", body(i, None)) for i in range(n)]

    with concurrent.futures.ThreadPoolExecutor(n + 1) as pool:
        sequential = pool.submit(one_by_one)
        concurrent_answers = list(pool.map(one, range(n)))
        sequential_answers = sequential.result()
    assert [r.status_code for r in concurrent_answers] == [200] * n, [r.text for r in concurrent_answers
                                                                      if r.status_code != 200]
    assert [r.status_code for r in sequential_answers] == [200] * n
    for i, (r, ref) in enumerate(zip(concurrent_answers, sequential_answers)):
        got, want = r.json()["choices"][0], ref.json()["choices"][0]
        assert (got["text"], got["token_ids"]) == (want["text"], want["token_ids"]), prompts[i]
        assert r.json()["usage"]["completion_tokens"] == len(want["token_ids"])
    _assert_healthy(server)


# ---- metrics ------------------------------------------------------------------------------------------
def test_metrics_prometheus_text(server):
    salt = uuid.uuid4().hex
    _complete(server, PREFIX + ENDINGS[0], salt=salt)
    _complete(server, PREFIX + ENDINGS[1], salt=salt)
    m = _metrics(server)
    assert m['jaxsmol_requests_total{endpoint="/v1/completions",status="200"}'] >= 2
    assert m['jaxsmol_requests_total{endpoint="/health",status="200"}'] >= 1
    assert m["jaxsmol_cache_lookups_total"] >= 2
    assert m["jaxsmol_cache_hits_total"] >= 1
    assert m["jaxsmol_cache_tokens_reused_total"] >= 250
    assert m["jaxsmol_cache_bytes"] > 0
    assert m["jaxsmol_prompt_tokens_total"] > 0 and m["jaxsmol_completion_tokens_total"] > 0
    assert "jaxsmol_cancelled_total" in m and "jaxsmol_rejected_total" in m and "jaxsmol_queue_depth" in m
    buckets = [(k, v) for k, v in m.items() if k.startswith("jaxsmol_time_to_first_token_seconds_bucket{")]
    assert buckets and buckets[-1][0] == 'jaxsmol_time_to_first_token_seconds_bucket{le="+Inf"}'
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative
    assert counts[-1] == m["jaxsmol_time_to_first_token_seconds_count"] >= 2
    assert m["jaxsmol_time_to_first_token_seconds_sum"] > 0
    text = httpx.get(server + "/metrics", timeout=30).text
    for name, kind in (("jaxsmol_requests_total", "counter"), ("jaxsmol_cache_bytes", "gauge"),
                       ("jaxsmol_time_to_first_token_seconds", "histogram")):
        assert f"# TYPE {name} {kind}" in text and f"# HELP {name} " in text


# ---- the aitest client --------------------------------------------------------------------------------
def test_aitest_cacheprobe_against_server(server):
    p = subprocess.run([sys.executable, "-m", "jaxsmol.cli.aitest", "--url", server, "--cacheprobe", "--predict", "4",
                        "1", "2", "3", "4", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("cached tokens"))
    cold, warm = (int(v) for v in row.split()[-2:])
    assert cold == 0 and warm > 0, p.stdout
    assert "identical outputs: yes" in p.stdout, p.stdout
    gen = next(line for line in p.stdout.splitlines() if line.startswith("generated ids")).split()[2:]
    assert len(gen) == 8  # 4 ids cold, 4 ids warm
