"""The OpenAI API as real clients speak it, against real `jaxsmol serve` daemons (the official `openai`
client and raw HTTP): content parts and roles, every prompt form, echo + logprobs and prompt_logprobs
(checked against the Hugging Face reference fixture), refused fields, limits, /tokenize and /detokenize,
and tenants (API keys, namespaces, admin routes).

Two daemons, started together and shared by the module: `api` (the real model, open, prefix cache on)
and `keyed` (`--api-keys FILE`, on the two-layer checkpoint: its tests are about keys and namespaces).
Cache-dependent tests use a fresh `cache_salt`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from daemon import REQUEST_TIMEOUT_S
from daemon import Server as _Server
from daemon import assert_error_body as _assert_error_body
from daemon import assert_healthy as _assert_healthy
from daemon import client as _client

pytestmark = pytest.mark.real

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "hf_reference.json").read_text(encoding="utf-8"))
TOL = 1e-3
KEYS = "# key namespace admin\nkey-a\nkey-b -\nkey-c team\nkey-d team\nkey-root - admin\n"
LONG = "Here is a list of facts. " + " ".join(f"Fact {i}: {i} times 3 is {3 * i}." for i in range(12))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):  # tiny_model_dir imports the default model once, unraced
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    # the bundled model with --matmul exact: its logprobs are the float32 weights', checked against the
    # Hugging Face reference to TOL (the default int8 class's error is stated in tests/test_quantized.py)
    started = {"api": _Server("--matmul", "exact"),
               "keyed": _Server("--model", str(tiny_model_dir), "--api-keys", str(keys))}
    try:
        yield {name: s.wait_ready() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def api(servers) -> str:
    return servers["api"].url


@pytest.fixture(scope="module")
def keyed(servers) -> str:
    return servers["keyed"].url


def _post(url: str, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    # json.dumps escapes a lone surrogate as \ud800 (httpx's json= would fail to encode it)
    return httpx.post(url + path, content=json.dumps(body).encode(), headers=headers, timeout=REQUEST_TIMEOUT_S)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


# ---- chat messages -----------------------------------------------------------------------------------
def test_content_parts_and_developer_role_equal_their_plain_forms(api):
    c = _client(api)
    kw = dict(model="m", max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    plain = c.chat.completions.create(messages=[{"role": "system", "content": "Answer in one word."},
                                                {"role": "user", "content": "Name a colour."}], **kw)
    parts = c.chat.completions.create(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}], **kw)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_and_named_messages(api):
    r = _client(api).chat.completions.create(model="m", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": "What is 6 x 7?", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}])
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens > 0


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
    [{"role": "user", "content": "hi \ud800"}],
    [{"role": "user"}],
])
def test_bad_messages_are_400(api, messages):
    _assert_error_body(_post(api, "/v1/chat/completions", {"messages": messages}), 400)


# ---- prompts -----------------------------------------------------------------------------------------
def test_every_prompt_form(api):
    c = _client(api)
    texts = ["The capital of France is", "Once upon a time"]
    ids = [_ok(_post(api, "/tokenize", {"prompt": t}))["tokens"] for t in texts]
    kw = dict(model="m", max_tokens=3, temperature=0, n=2)
    by_text = c.completions.create(prompt=texts, **kw)
    by_ids = c.completions.create(prompt=ids, **kw)  # a list of token-id lists
    assert [ch.index for ch in by_text.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in by_text.choices] == [ch.text for ch in by_ids.choices]
    singles = [c.completions.create(model="m", prompt=t, max_tokens=3, temperature=0).choices[0].text for t in texts]
    assert [ch.text for ch in by_text.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # each prompt once, not n times
    assert 0 < by_text.usage.completion_tokens <= 4 * 3


def test_cold_n2_reports_no_cached_tokens(api):
    salt = uuid.uuid4().hex
    r = _ok(_post(api, "/v1/completions", {"prompt": LONG, "n": 2, "max_tokens": 2, "cache_salt": salt}))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = _ok(_post(api, "/v1/completions", {"prompt": LONG, "n": 2, "max_tokens": 2, "cache_salt": salt}))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize(api):
    t = _ok(_post(api, "/tokenize", {"prompt": "Hello 123", "return_token_strs": True}))
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 2048
    assert _ok(_post(api, "/detokenize", {"tokens": t["tokens"]}))["prompt"] == "Hello 123"
    msgs = [{"role": "user", "content": "Hi"}]
    chat = _ok(_post(api, "/tokenize", {"messages": msgs}))
    usage = _client(api).chat.completions.create(model="m", messages=msgs, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    _assert_error_body(_post(api, "/detokenize", {"tokens": [10**7]}), 400)
    _assert_error_body(_post(api, "/tokenize", {}), 400)
    _assert_error_body(_post(api, "/tokenize", {"prompt": "\ud800"}), 400)


# ---- scoring: echo, logprobs, prompt_logprobs ----------------------------------------------------------
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_echo_logprobs_match_hf(api, case):
    ids = case["prompt_ids"] + case["greedy_ids"]
    r = _ok(_post(api, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 5,
                                           "prompt_logprobs": 5}))
    choice = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 0 and choice["text"] == _ok(_post(api, "/detokenize",
                                                                                {"tokens": ids}))["prompt"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and all(a <= b for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    worst = 0.0
    for p in range(1, len(ids)):
        ref = case["full_top"][p - 1]
        mine = {int(k): v["logprob"] for k, v in plp[p].items()}
        assert lp["token_logprobs"][p] == mine[ids[p]]
        for i, v in zip(ref["ids"], ref["logprobs"]):
            if i in mine:
                worst = max(worst, abs(mine[i] - v))
        ranked = sorted((v for k, v in plp[p].items() if v["rank"] <= 5), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2, 3, 4, 5]
        worst = max(worst, max(abs(v["logprob"] - w) for v, w in zip(ranked, ref["logprobs"])))
    assert worst <= TOL


def test_prompt_logprobs_equal_with_and_without_a_cached_prefix(api):
    salt = uuid.uuid4().hex
    body = {"prompt": LONG + " Question: what is fact 5?", "max_tokens": 1, "logprobs": 2, "echo": True,
            "temperature": 0, "cache_salt": salt}
    _ok(_post(api, "/v1/completions", {**body, "prompt": LONG, "echo": False}))  # caches the prefix
    warm = _ok(_post(api, "/v1/completions", body))
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    cold = _ok(_post(api, "/v1/completions", {**body, "use_prefix_cache": False}))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]


def test_logprobs_zero_returns_the_chosen_tokens(api):
    r = _client(api).completions.create(model="m", prompt="The quick brown", max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(v <= 0 for v in lp.token_logprobs)
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]


def test_streamed_echo(api):
    chunks = list(_client(api).completions.create(model="m", prompt="Once upon a time", max_tokens=3, temperature=0,
                                                  echo=True, stream=True))
    full = _client(api).completions.create(model="m", prompt="Once upon a time", max_tokens=3, temperature=0,
                                           echo=True)
    assert chunks[0].choices[0].text == "Once upon a time"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


# ---- refused fields and limits -------------------------------------------------------------------------
REFUSED = [("best_of", 2), ("logit_bias", {"50256": -100}), ("suffix", " the end"), ("presence_penalty", 0.5),
           ("frequency_penalty", 1.0), ("tools", [{"type": "function", "function": {"name": "f"}}]),
           ("tool_choice", "required"), ("functions", [{"name": "f"}])]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_fields_are_400_naming_them(api, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = _post(api, path, {**body, "max_tokens": 1, field: value})
    _assert_error_body(r, 400)
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_json_schema_output_parses_and_validates(api):
    """response_format json_schema through the official client, streamed and not: the text parses and
    matches the schema; a bad schema is a 400 naming response_format."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "enum": ["France", "Italy", "Spain"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    messages = [{"role": "user", "content": "Name a city in Europe, as JSON."}]
    client = openai.OpenAI(base_url=api + "/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                       response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0.8,
                                            seed=3, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    bad = _post(api, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}})
    _assert_error_body(bad, 400)
    assert bad.json()["error"]["param"] == "response_format"


def test_neutral_values_and_unknown_extensions_are_accepted(api):
    _ok(_post(api, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1, "presence_penalty": 0,
                                       "logit_bias": {}, "response_format": {"type": "text"}, "my_extension": 1}))


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "hi", "stop": "x" * 129},
    {"prompt": ["hi"] * 33},
    {"prompt": ["hi"] * 8, "n": 8, "max_tokens": 1},
    {"prompt": ["hi", "yo"], "n": 8, "max_tokens": 1100},
    {"prompt": "hi \ud800"},
    {"prompt": "hi", "stop": "\udfff"},
    {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True},
])
def test_limits_are_400(api, body):
    _assert_error_body(_post(api, "/v1/completions", body), 400)
    _assert_healthy(api)


# ---- tenants -------------------------------------------------------------------------------------------
def test_requests_without_a_valid_key_are_401(keyed):
    for key in (None, "nope"):
        _assert_error_body(_post(keyed, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key), 401)
        _assert_error_body(_post(keyed, "/tokenize", {"prompt": "hi"}, key), 401)
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "wrong").models.list()
    assert _client(keyed, "key-a").models.list().data
    _assert_healthy(keyed)  # liveness needs no key


def test_tenants_never_see_each_others_prefixes(keyed):
    prompt = LONG + f" Secret {uuid.uuid4().hex}."
    a = _client(keyed, "key-a")
    a.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert a.completions.create(model="m", prompt=prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0
    b = _client(keyed, "key-b")
    # the victim's prompt, and a prefix of it (each probe new in its partition of B's namespace)
    for probe, extra in ((prompt, {}), (prompt[: len(prompt) // 2], {"cache_salt": "probe"})):
        r = b.completions.create(model="m", prompt=probe, max_tokens=0, extra_body=extra)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    # keys that share a namespace share entries; cache_salt still partitions within it
    _client(keyed, "key-c").completions.create(model="m", prompt=prompt, max_tokens=1)
    d = _client(keyed, "key-d")
    assert d.completions.create(model="m", prompt=prompt, max_tokens=0).usage.prompt_tokens_details.cached_tokens > 0
    salted = d.completions.create(model="m", prompt=prompt, max_tokens=0, extra_body={"cache_salt": "s"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_admin_routes_need_an_admin_key(keyed):
    _assert_error_body(_post(keyed, "/v1/cache/flush", {}, "key-a"), 403)
    _assert_error_body(_post(keyed, "/v1/cache/flush", {}), 401)
    r = httpx.get(keyed + "/metrics", headers={"authorization": "Bearer key-a"}, timeout=30)
    _assert_error_body(r, 403)
    assert httpx.get(keyed + "/metrics", headers={"authorization": "Bearer key-root"}, timeout=30).status_code == 200
    assert _ok(_post(keyed, "/v1/cache/flush", {}, "key-root")) == {"flushed": True}


def test_a_finished_stream_is_not_a_cancellation_and_its_answer_is_saved(api):
    def cancelled() -> float:
        text = httpx.get(api + "/metrics", timeout=30).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("jaxsmol_cancelled_total")))

    salt, before = uuid.uuid4().hex, cancelled()
    stream = _client(api).completions.create(model="m", prompt=LONG, max_tokens=6, temperature=0, stream=True,
                                             extra_body={"cache_salt": salt, "return_token_ids": True})
    ids = [i for chunk in stream for c in chunk.choices for i in (c.model_extra or {}).get("token_ids") or []]
    assert ids and cancelled() == before
    prompt = _ok(_post(api, "/tokenize", {"prompt": LONG}))["tokens"] + ids + [28]
    r = _ok(_post(api, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "cache_salt": salt}))
    # the next turn reuses the prompt and the streamed answer (all but its last token, never fed back)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 2
