"""End-to-end tests of `jaxsmol serve` (cli/serve.py, cli/completions.py, cli/worker.py, cli/metrics.py, cli/client.py,
cli/aitest.py); the OpenAI API in depth and tenants are in tests/test_openai_api.py.

Every test talks to a REAL server process (`python -m cli.main serve`) over loopback, mostly through
the official `openai` client, else through httpx. Servers start two at a time, so that their
start-ups overlap; `server` launches the second pair once the first is up, so that its start-up
overlaps the tests:

* `server`          — the default daemon (prefix cache on, --max-queue 64), ctx 2048;
* `nocache_server`  — the same with --no-prefix-cache: the reference every cached answer must equal;
* `queue_server`    — --max-queue 1, for the 503 + Retry-After path;
* `sigterm_server`  — a throw-away daemon the SIGTERM test stops.

Tests that depend on the prefix cache use a fresh `cache_salt` so that the module-shared cache (and
the flush test) cannot change what they see.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import httpx  # noqa: E402  (test extra)
import openai  # noqa: E402  (test extra)

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[1]
CTX = 2048
START_TIMEOUT_S = 180  # two servers start at once on a small, shared machine
REQUEST_TIMEOUT_S = 120

# ~290 tokens of text shared by the prefix-cache requests, then different endings
PREFIX = "Here is a list of facts. " + " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(18))
SHORT_PREFIX = PREFIX[:400]  # ~100 tokens: enough for the salt / bypass / flush checks, cheaper to prefill
ENDINGS = (" Question: what is fact 3? Answer:", " Question: what is fact 11? Answer:")


# ---- servers ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """One `jaxsmol serve` subprocess on a free loopback port; its stdout+stderr go to a temporary file."""

    def __init__(self, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.cmd = [sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--ctx", str(CTX), *extra]
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.ready = False

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "_Server":
        deadline = time.monotonic() + timeout
        while not self.ready:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(f"server {self.cmd} exited with {rc} before it was ready:\n{self.output()}")
            try:
                self.ready = httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                pass
            if not self.ready:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"server {self.cmd} not healthy after {timeout} s:\n{self.output()}")
                time.sleep(0.25)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()


_CONFIGS = {"main": (), "nocache": ("--no-prefix-cache",), "queue1": ("--max-queue", "1"), "sigterm": ()}


@pytest.fixture(scope="module")
def _launch():
    """launch(*names) starts the named servers that are not running yet (without waiting for them)."""
    from jaxsmol.default_model import default_model_dir
    from jaxsmol.errors import JaxsmolError

    try:
        default_model_dir(progress=False)  # imported once here, not raced by the servers
    except JaxsmolError as e:
        pytest.fail(f"the default model is needed for this test: {e}", pytrace=False)
    servers: dict[str, _Server] = {}

    def launch(*names: str) -> dict[str, _Server]:
        for name in names:
            if name not in servers:
                servers[name] = _Server(*_CONFIGS[name])
        return servers

    yield launch
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def server(_launch) -> str:
    servers = _launch("main", "nocache")
    servers["main"].wait_ready()
    servers["nocache"].wait_ready()
    _launch("queue1", "sigterm")  # their start-up overlaps the tests that follow
    return servers["main"].url


@pytest.fixture(scope="module")
def nocache_server(_launch) -> str:
    return _launch("main", "nocache")["nocache"].wait_ready().url


@pytest.fixture(scope="module")
def queue_server(_launch) -> str:
    return _launch("queue1", "sigterm")["queue1"].wait_ready().url


@pytest.fixture
def sigterm_server(_launch) -> _Server:
    return _launch("queue1", "sigterm")["sigterm"].wait_ready()


@pytest.fixture(scope="module")
def tokenizer():
    from jaxsmol.default_model import default_model_dir
    from jaxsmol.tokenizer import Tokenizer

    return Tokenizer.load(default_model_dir(progress=False))


# ---- helpers ------------------------------------------------------------------------------------------
def _client(url: str) -> "openai.OpenAI":
    # max_retries=0: the client must not hide a 503 (or anything else) behind a retry
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def _complete(url: str, prompt, *, salt: str | None = None, max_tokens: int = 4, **extra):
    body = {"return_token_ids": True, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return _client(url).completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body=body)


def _ids(choice) -> list[int]:
    ids = (choice.model_extra or {}).get("token_ids")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), choice
    return ids


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def _post(url: str, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> "httpx.Response":
    return httpx.post(url + path, json=body, timeout=timeout)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def _metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; fails on a line that is not a valid sample or comment."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[m[1] + (m[2] or "")] = float(m[3])
    return out


def _assert_healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def _assert_error_body(r: "httpx.Response", status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err.get("type"), str), err


# ---- basic endpoints ----------------------------------------------------------------------------------
def test_health_and_models(server):
    _assert_healthy(server)
    models = _client(server).models.list().data
    assert len(models) == 1
    assert models[0].id and models[0].object == "model"
    assert models[0].model_extra.get("max_model_len") == CTX


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


# ---- bad requests -------------------------------------------------------------------------------------
_C, _CHAT = "/v1/completions", "/v1/chat/completions"
_OK_MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (id, method, path, body: bytes | JSON-able | None, status)
    ("malformed-json", "POST", _C, b'{"prompt": "hi",', 400),
    ("body-is-a-list", "POST", _C, b"[1, 2, 3]", 400),
    ("body-is-a-string", "POST", _C, b'"hi"', 400),
    ("body-is-null", "POST", _C, b"null", 400),
    ("empty-body", "POST", _C, b"", 400),
    ("missing-prompt", "POST", _C, {"max_tokens": 1}, 400),
    ("prompt-is-a-number", "POST", _C, {"prompt": 5}, 400),
    ("prompt-is-an-object", "POST", _C, {"prompt": {"text": "hi"}}, 400),
    ("prompt-list-of-strings-and-ids", "POST", _C, {"prompt": ["a", 1]}, 400),
    ("prompt-empty-in-a-list", "POST", _C, {"prompt": ["a", ""]}, 400),
    ("lone-surrogate", "POST", _C, b'{"prompt": "hi \\ud800", "max_tokens": 1}', 400),
    ("chat-lone-surrogate", "POST", _CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400),
    ("chat-image-part", "POST", _CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("too-many-stops", "POST", _C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("work-over-cap", "POST", _C, {"prompt": ["a", "b"], "n": 8, "max_tokens": 1100}, 400),
    ("token-id-too-large", "POST", _C, {"prompt": [1, 10**6]}, 400),
    ("token-id-huge", "POST", _C, {"prompt": [10**30]}, 400),
    ("token-id-negative", "POST", _C, {"prompt": [1, -1]}, 400),
    ("empty-string-prompt", "POST", _C, {"prompt": ""}, 400),
    ("empty-id-prompt", "POST", _C, {"prompt": []}, 400),
    ("prompt-over-context", "POST", _C, {"prompt": [1] * 3000, "max_tokens": 1}, 400),
    ("prompt-plus-max-tokens-over-context", "POST", _C, {"prompt": [1] * 100, "max_tokens": CTX}, 400),
    ("negative-max-tokens", "POST", _C, {"prompt": "hi", "max_tokens": -1}, 400),
    ("huge-max-tokens", "POST", _C, {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("max-tokens-a-string", "POST", _C, {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("n-zero", "POST", _C, {"prompt": "hi", "n": 0}, 400),
    ("n-100", "POST", _C, {"prompt": "hi", "n": 100}, 400),
    ("negative-temperature", "POST", _C, {"prompt": "hi", "temperature": -1}, 400),
    ("top-p-zero", "POST", _C, {"prompt": "hi", "top_p": 0}, 400),
    ("top-p-over-one", "POST", _C, {"prompt": "hi", "top_p": 1.5}, 400),
    ("negative-top-k", "POST", _C, {"prompt": "hi", "top_k": -1}, 400),
    ("huge-top-k", "POST", _C, {"prompt": "hi", "top_k": 10**12, "max_tokens": 1}, 400),
    ("negative-seed", "POST", _C, {"prompt": "hi", "seed": -1}, 400),
    ("logprobs-over-5", "POST", _C, {"prompt": "hi", "logprobs": 6}, 400),
    ("stop-wrong-type", "POST", _C, {"prompt": "hi", "stop": 5}, 400),
    ("bad-request-while-streaming", "POST", _C, {"prompt": [10**6], "stream": True}, 400),
    ("chat-missing-messages", "POST", _CHAT, {"max_tokens": 1}, 400),
    ("chat-empty-messages", "POST", _CHAT, {"messages": []}, 400),
    ("chat-bad-role", "POST", _CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat-content-not-a-string", "POST", _CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("chat-message-not-an-object", "POST", _CHAT, {"messages": ["hi"]}, 400),
    ("chat-top-logprobs-over-20", "POST", _CHAT, {"messages": _OK_MSG, "logprobs": True, "top_logprobs": 21}, 400),
    ("chat-over-context", "POST", _CHAT,
     {"messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": 1}, 400),
    ("chat-negative-max-completion-tokens", "POST", _CHAT, {"messages": _OK_MSG, "max_completion_tokens": -1}, 400),
    ("body-over-size-limit", "POST", _C, b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413),
    ("unknown-route", "POST", "/v1/nothing-here", {"prompt": "hi"}, 404),
    ("unknown-get-route", "GET", "/nope", None, 404),
    ("get-on-completions", "GET", _C, None, 405),
    ("post-on-models", "POST", "/v1/models", {}, 405),
]


@pytest.mark.parametrize("method,path,body,status", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, method, path, body, status):
    kw = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = httpx.request(method, server + path, timeout=60, **kw)
    _assert_error_body(r, status)
    _assert_healthy(server)


def test_body_over_size_limit_without_content_length(server):
    """A chunked body carries no Content-Length: the limit must hold for it too."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a " * (512 << 10)
        yield b'", "max_tokens": 1}'
    r = httpx.post(server + _C, content=chunks(), headers={"content-type": "application/json"}, timeout=120)
    _assert_error_body(r, 413)
    _assert_healthy(server)


def test_edge_values_that_are_valid(server):
    # the largest seed is valid, also for n > 1 (choice i samples with seed + i)
    r = _post(server, _C, {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**63 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    # max_tokens 0: no tokens, no error
    r = _post(server, _C, {"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 0


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


# ---- a client that leaves -----------------------------------------------------------------------------
_LONG_STORY = "Once upon a time, in a land far away, there lived a dragon who"  # no early end of text


def test_client_disconnect_mid_stream(server):
    before = _metrics(server)["jaxsmol_cancelled_total"]
    body = {"prompt": _LONG_STORY, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
        with c.stream("POST", server + _C, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    break
    _assert_abandoned_job_cancelled(server, before)


def test_client_disconnect_before_a_non_streamed_answer(server):
    """A client that gives up on a non-streamed request (here: its read timeout) frees the model too."""
    before = _metrics(server)["jaxsmol_cancelled_total"]
    body = {"prompt": _LONG_STORY, "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + _C, json=body, timeout=httpx.Timeout(60, read=3))
    _assert_abandoned_job_cancelled(server, before)


def _assert_abandoned_job_cancelled(server: str, cancelled_before: float) -> None:
    # the server answers the next request and stops the abandoned generation long before its 400 tokens
    after = _complete(server, "Hello", max_tokens=2)
    assert after.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 30
    while _metrics(server)["jaxsmol_cancelled_total"] <= cancelled_before:
        assert time.monotonic() < deadline, "the abandoned request's generation was never cancelled"
        time.sleep(0.25)
    _assert_healthy(server)


# ---- the aitest client --------------------------------------------------------------------------------
def test_aitest_cacheprobe_against_server(server):
    p = subprocess.run([sys.executable, "-m", "cli.aitest", "--url", server, "--cacheprobe", "--predict", "4",
                        "1", "2", "3", "4", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(line for line in p.stdout.splitlines() if line.startswith("cached tokens"))
    cold, warm = (int(v) for v in row.split()[-2:])
    assert cold == 0 and warm > 0, p.stdout
    assert "identical outputs: yes" in p.stdout, p.stdout
    gen = next(line for line in p.stdout.splitlines() if line.startswith("generated ids")).split()[2:]
    assert len(gen) == 8  # 4 ids cold, 4 ids warm


# ---- queue full ---------------------------------------------------------------------------------------
def test_queue_full_answers_503_with_retry_after(queue_server):
    n = 6
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait(timeout=60)
        return _post(queue_server, _C, {"prompt": f"Story number {i}: once upon a time", "max_tokens": 60,
                                        "temperature": 0}, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, range(n)))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 503}, [r.text for r in answers]
    assert 200 in statuses and 503 in statuses, statuses
    for r in answers:
        if r.status_code == 503:
            _assert_error_body(r, 503)
            assert int(r.headers["retry-after"]) > 0
        else:
            assert r.json()["usage"]["completion_tokens"] > 0
    _assert_healthy(queue_server)
    assert _metrics(queue_server)["jaxsmol_rejected_total"] == statuses.count(503)
    assert _post(queue_server, _C, {"prompt": "hi", "max_tokens": 1}).status_code == 200


# ---- SIGTERM drains -----------------------------------------------------------------------------------
def test_sigterm_finishes_requests_in_flight(sigterm_server, server):
    url, proc = sigterm_server.url, sigterm_server.proc
    bodies = [{"prompt": f"Chapter {i}. The old lighthouse keeper", "max_tokens": 30, "temperature": 0,
               "return_token_ids": True} for i in (1, 2)]
    results = [None, None]

    def one(i):
        try:
            results[i] = _post(url, _C, bodies[i], timeout=300)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    # both accepted: one running, one waiting in the queue
    deadline = time.monotonic() + 60
    while True:
        h = httpx.get(url + "/health", timeout=30).json()
        if h["busy"] and h["queued"] == 1:
            break
        assert time.monotonic() < deadline and all(r is None for r in results), (h, results)
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within 120 s of SIGTERM:\n{sigterm_server.output()}")
    for body, r in zip(bodies, results):
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200, r.text
        ref = _post(server, _C, body).json()["choices"][0]  # the full answer, from the other server
        got = r.json()["choices"][0]
        assert (got["text"], got["token_ids"], got["finish_reason"]) == \
            (ref["text"], ref["token_ids"], ref["finish_reason"])
        assert r.json()["usage"]["completion_tokens"] == len(ref["token_ids"])
    assert rc == 0, f"exit status {rc}:\n{sigterm_server.output()}"
