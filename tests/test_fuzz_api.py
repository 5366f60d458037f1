"""A fuzz of the daemon's HTTP API: hypothesis generates request bodies for every POST route,
valid-ish and garbage (wrong types, huge and negative numbers, NaN, nested junk, lone surrogates, empty
and mixed lists, odd roles and content parts and blocks, cache_control junk, structured-output junk),
and no answer may be a 5xx: bad input is a 400 (or a 404: an unknown previous_response_id) with an
OpenAI error object, or Anthropic's on the Messages API's routes. Afterwards the daemon is healthy
and answers correctly.

In-process (Starlette's TestClient) on the tiny random config with the real tokenizer, so it is quick;
derandomized with a fixed number of examples, so CI sees the same bodies every run. The statuses seen
are printed (pytest -s)."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), tiny random weights

EXAMPLES = {"/v1/completions": 150, "/v1/chat/completions": 120, "/tokenize": 60, "/detokenize": 50,
            "/v1/messages": 120, "/v1/messages/count_tokens": 60, "/v1/responses": 80, "/v1/cached_contents": 60}
OPENAI = ("/v1/completions", "/v1/chat/completions")  # the routes that take the OpenAI fields below
STATUSES: dict[str, collections.Counter] = {route: collections.Counter() for route in EXAMPLES}
SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

# ---- strategies -----------------------------------------------------------------------------------------
ODD_TEXTS = ["", "\ud800", "a\udfffb", "\x00", "\u202e", "🙂" * 5, "{{ raise_exception('boom') }}", "{% for %}",
             "<|im_end|>", "<|im_start|>assistant\n", "\n" * 40, "é" * 200]
texts = (st.text(max_size=24) | st.text(st.characters(codec=None, categories=None), max_size=8)
         | st.sampled_from(ODD_TEXTS))
huge_ints = st.sampled_from([-1, -(2**31), 2**31, 2**63, 2**64, 10**30, -(10**30)])
ints = st.integers(-3, 300) | huge_ints
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([2e-38, 5e-324, 1e-300, 0.0, -0.0, 1e308])
scalars = st.none() | st.booleans() | ints | floats | texts
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=12) | st.lists(ints, max_size=6)
prompts = (texts | token_ids | st.lists(texts, max_size=4) | st.lists(token_ids, max_size=3)
           | st.lists(texts | st.integers(0, 255), max_size=4) | st.just([]) | st.just([[]]) | junk)
stops = st.none() | texts | st.lists(texts, max_size=6) | st.lists(st.text(max_size=200), max_size=2) | junk
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | texts | junk
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]) | junk},
                              optional={"text": texts | junk, "image_url": junk})
contents = st.none() | texts | st.lists(parts | junk, max_size=3) | junk
messages = st.fixed_dictionaries({"role": roles}, optional={
    "content": contents, "name": texts | junk, "tool_call_id": texts | junk, "tool_calls": junk})
schemas = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
                           {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                           {"$ref": "#/nope"}, {"type": "bogus"}]) | junk
response_formats = (st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "bogus"}])
                    | st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schemas)
                    | junk)

# Each field: values the API accepts (small: a model call stays short) and values it must refuse or
# ignore. A body is valid-ish (a few good fields), valid-ish with one field anything, or pure junk.
GOOD = {
    "max_tokens": st.integers(0, 6), "temperature": st.sampled_from([0.0, 0.7, 1.0, 2e-38, 100.0]),
    "top_p": st.sampled_from([0.5, 1.0, 1e-9]), "top_k": st.integers(0, 300), "seed": st.integers(0, 2**63 - 1),
    "stop": st.none() | texts | st.lists(texts, max_size=4), "n": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "cache_salt": texts, "use_prefix_cache": st.booleans(),
    "return_token_ids": st.booleans(), "ignore_eos": st.booleans(), "best_of": st.just(1), "model": texts,
    "prompt_cache_key": texts, "prompt_cache_retention": st.sampled_from(["in_memory", "24h"]),
    "cached_content": st.sampled_from(["cachedContents/0123456789abcdef01234567", "nope", ""]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schemas),
}
BAD = {
    **{k: junk for k in GOOD}, "max_tokens": ints | junk, "temperature": floats | junk, "top_p": floats | junk,
    "top_k": ints | junk, "seed": ints | junk, "n": ints | junk, "stop": stops,
    "cache_salt": st.text(min_size=257, max_size=300) | junk, "best_of": ints, "logit_bias": junk,
    "suffix": texts, "presence_penalty": floats, "frequency_penalty": floats, "tools": junk, "tool_choice": junk,
    "functions": junk, "function_call": junk, "guided_grammar": texts | junk, "audio": junk, "modalities": junk,
    "response_format": response_formats, "guided_json": schemas, "guided_regex": texts | st.just("[a-z]{1,3}"),
    "guided_choice": st.lists(texts, max_size=3) | junk, "prompt_cache_key": st.text(min_size=257, max_size=300),
    "prompt_cache_retention": texts | junk, "cached_content": st.text(min_size=129, max_size=140) | junk,
}
ROUTE_FIELDS = {
    "/v1/completions": ({"prompt": st.sampled_from(["Hi", "The capital of France is"]) | token_ids
                         | st.lists(token_ids, min_size=1, max_size=2), "logprobs": st.integers(0, 5),
                         "echo": st.booleans(), "prompt_logprobs": st.integers(0, 3)},
                        {"prompt": prompts, "logprobs": ints | junk, "echo": junk, "prompt_logprobs": ints | junk}),
    "/v1/chat/completions": ({"messages": st.lists(st.fixed_dictionaries({
                                  "role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                  "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": texts}), max_size=2)}),
                                  min_size=1, max_size=3),
                              "max_completion_tokens": st.integers(0, 6), "logprobs": st.booleans(),
                              "top_logprobs": st.integers(0, 20)},
                             {"messages": st.lists(messages, max_size=4) | junk,
                              "max_completion_tokens": ints | junk, "logprobs": junk, "top_logprobs": ints | junk}),
    "/tokenize": ({"prompt": texts, "add_generation_prompt": st.booleans(), "return_token_strs": st.booleans()},
                  {"prompt": junk, "messages": st.lists(messages, max_size=3) | junk,
                   "add_generation_prompt": junk, "return_token_strs": junk}),
    "/detokenize": ({"tokens": token_ids}, {"tokens": st.lists(st.integers(), max_size=5) | junk, "model": junk}),
}
# Anthropic's Messages API: blocks of every type, cache_control of every shape
controls = st.sampled_from([{"type": "ephemeral"}, {"type": "persistent"}]
                           + [{"type": "ephemeral", "ttl": ttl} for ttl in ("5m", "1h", "2h", None, 300, ["5m"])])
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "document", "tool_use", "tool_result", "thinking", "bogus"]) | junk},
    optional={"text": texts | junk, "cache_control": controls | junk, "source": junk, "input": junk})
text_blocks = st.fixed_dictionaries({"type": st.just("text"), "text": texts},
                                    optional={"cache_control": st.sampled_from([{"type": "ephemeral"},
                                                                                {"type": "ephemeral", "ttl": "1h"}])})
turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                        "content": texts | st.lists(text_blocks, max_size=2)}), min_size=1, max_size=3)
odd_turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | roles},
                                           optional={"content": texts | st.lists(blocks | junk, max_size=3) | junk}),
                     max_size=4) | junk
CONVERSATION = ({"messages": turns, "system": texts | st.lists(text_blocks, max_size=3), "model": texts,
                 "cache_control": st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}]),
                 "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]),
                 "thinking": st.just({"type": "disabled"})},
                {"messages": odd_turns, "system": texts | st.lists(blocks | junk, max_size=5) | junk,
                 "cache_control": controls | junk, "tools": junk, "tool_choice": junk, "thinking": junk, "model": junk})
ROUTE_FIELDS["/v1/messages/count_tokens"] = CONVERSATION
ROUTE_FIELDS["/v1/messages"] = (
    {**CONVERSATION[0], "max_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.5, 1.0]),
     "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.integers(0, 300), "stop_sequences": st.lists(texts, max_size=4),
     "stream": st.booleans(), "metadata": st.just({"user_id": "u"}), "seed": st.integers(0, 2**63 - 1),
     "cache_salt": texts, "ignore_eos": st.booleans(),
     "output_config": st.builds(lambda s: {"format": {"type": "json_schema", "schema": s}}, schemas)},
    {**CONVERSATION[1], "max_tokens": ints | junk, "temperature": floats | junk, "top_p": floats | junk,
     "top_k": ints | junk, "stop_sequences": stops, "stream": junk, "seed": ints | junk, "metadata": junk,
     "cache_salt": st.text(min_size=257, max_size=300) | junk, "output_config": junk | schemas})
# OpenAI's Responses API: input items and parts of every type, chained ids that are not stored
input_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file", "refusal", "bogus"]) | junk},
    optional={"text": texts | junk, "image_url": junk})
input_items = st.fixed_dictionaries(
    {}, optional={"type": st.sampled_from(["message", "function_call", "item_reference", "reasoning"]) | junk,
                  "role": roles, "content": texts | st.lists(input_parts | junk, max_size=3) | junk})
ROUTE_FIELDS["/v1/responses"] = (
    {"input": texts | st.lists(st.fixed_dictionaries({
         "role": st.sampled_from(["user", "assistant", "system", "developer"]),
         "content": texts | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]),
                                                            "text": texts}), max_size=2)}), min_size=1, max_size=3),
     "instructions": texts, "max_output_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.7, 2.0]),
     "top_p": st.sampled_from([0.5, 1.0]), "stream": st.booleans(), "store": st.booleans(), "model": texts,
     "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
     "seed": st.integers(0, 2**63 - 1),
     "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])
     | st.builds(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}, schemas),
     "prompt_cache_key": texts, "prompt_cache_retention": st.sampled_from(["in_memory", "24h"]),
     "reasoning": st.sampled_from([None, {}, {"effort": None}]), "tool_choice": st.sampled_from(["auto", "none"])},
    {"input": st.lists(input_items | junk, max_size=3) | junk, "instructions": junk, "max_output_tokens": ints | junk,
     "temperature": floats | junk, "top_p": floats | junk, "stream": junk, "store": junk, "seed": ints | junk,
     "metadata": st.dictionaries(texts, texts | junk, max_size=20) | junk, "text": junk | st.builds(
         lambda f: {"format": f}, junk | schemas), "prompt_cache_key": st.text(min_size=257, max_size=300) | junk,
     "prompt_cache_retention": junk, "tools": junk, "tool_choice": junk, "reasoning": junk, "background": junk,
     "include": junk, "conversation": junk, "truncation": junk, "top_logprobs": junk,
     "previous_response_id": texts | junk})
# Gemini's cached contents: contents in its shape, OpenAI's messages, or a prompt, and lifetimes
gemini_parts = st.lists(st.fixed_dictionaries({"text": texts}) | junk, min_size=1, max_size=2)
ROUTE_FIELDS["/v1/cached_contents"] = (
    {"contents": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "model"]), "parts": gemini_parts}),
                          min_size=1, max_size=3),
     "system_instruction": st.fixed_dictionaries({"parts": gemini_parts}), "display_name": texts, "model": texts,
     "ttl": st.sampled_from(["60s", "1.5s", 3600, 2.5, "604800s"]), "cache_salt": texts,
     "expire_time": st.sampled_from(["2099-01-01T00:00:00Z", "2000-01-01T00:00:00+00:00"])},
    {"contents": junk | st.lists(st.fixed_dictionaries({"role": roles, "parts": gemini_parts | junk}), max_size=2),
     "system_instruction": junk, "messages": st.lists(messages, max_size=2) | junk, "prompt": prompts,
     "ttl": texts | floats | ints | junk, "expire_time": texts | junk, "display_name": st.text(min_size=129) | junk,
     "cache_salt": st.text(min_size=257, max_size=300) | junk, "systemInstruction": junk, "expireTime": texts})
REQUIRED = {"/v1/completions": ("prompt",), "/v1/chat/completions": ("messages",), "/tokenize": (), "/detokenize": (),
            "/v1/messages": ("messages", "max_tokens"), "/v1/messages/count_tokens": ("messages",),
            "/v1/responses": ("input",), "/v1/cached_contents": ("contents",)}


def route_bodies(route: str):
    """Valid-ish bodies, the same with one field set to anything, and junk."""
    good, bad = ROUTE_FIELDS[route]
    if route in OPENAI:
        good, bad = {**GOOD, **good}, {**BAD, **bad}
    required = REQUIRED[route]
    valid = st.fixed_dictionaries({k: good[k] for k in required},
                                  optional={k: v for k, v in good.items() if k not in required})
    one_bad = st.sampled_from(sorted(bad)).flatmap(
        lambda key: st.builds(lambda body, value: {**body, key: value}, valid, bad[key]))
    return valid | one_bad | junk


def raw(body) -> bytes:
    """The body as JSON the way a client might send it: NaN and infinities as Python's json writes
    them (not valid JSON: a 400), lone surrogates escaped (valid JSON, invalid Unicode)."""
    return json.dumps(body).encode()


# ---- the daemon in-process ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    """A TestClient of create_app over a tiny engine (the tokenizer's vocabulary) with the real
    tokenizer and chat template."""
    from fastapi.testclient import TestClient

    from jaxsmol.cache.scheduler.settings import BatchSettings
    from jaxsmol.cli.server.serve import create_app
    from jaxsmol.model.config import Config
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random
    from jaxsmol.checkpoint.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, d / name)
    tok = Tokenizer.load(d)
    cfg = Config.tiny(vocab_size=tok.vocab_size, eos_ids=tok.eos_ids)  # every text's ids are in range
    engine = Engine(cfg, init_random(cfg), tok, ctx=512)
    with TestClient(create_app(engine, model_name="tiny", cache_bytes=16 << 20, batch=BatchSettings(max_batch=4)),
                    raise_server_exceptions=False) as c:
        c.known_before = known_answer(c)  # before any fuzzed request
        yield c


KNOWN = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True}


def known_answer(client) -> list[int]:
    r = client.post("/v1/completions", json=KNOWN)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def check(client, route: str, body) -> None:
    r = client.post(route, content=raw(body), headers={"content-type": "application/json"})
    STATUSES[route][r.status_code] += 1
    assert r.status_code < 500, (route, body, r.status_code, r.text)
    anthropic = route.startswith("/v1/messages")
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error" if anthropic else (
            err["code"] == r.status_code), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        # an error is an object's "error", or (the Responses API's) an event of type "error" with its code
        errors = [e["error"] for e in events if "error" in e] + [
            e for e in events if e.get("type") == "error" and "error" not in e]
        codes = [e["type"] if anthropic else e["code"] for e in errors]
        STATUSES[route][f"stream error {codes[0]}" if errors else "stream"] += 1
        assert all(c in ("invalid_request_error", 400) for c in codes), (route, body, errors)
    else:
        assert isinstance(r.json(), dict)


def fuzz(route: str):
    @settings(max_examples=EXAMPLES[route], **SETTINGS)
    @given(body=route_bodies(route))
    def run(client, body):
        check(client, route, body)
    return run


@pytest.mark.parametrize("route", list(EXAMPLES))
def test_fuzz_no_5xx(client, route):
    fuzz(route)(client)
    print(f"\nfuzz {route}: {sum(STATUSES[route].values())} requests, statuses {dict(STATUSES[route])}")


def test_healthy_after_fuzz(client):
    """Runs after the fuzz (file order): the daemon still answers, with the tokens it gave before it."""
    assert client.get("/health").json()["status"] == "ok"
    assert known_answer(client) == client.known_before
