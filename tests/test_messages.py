"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as the `anthropic` SDK speaks
it, against one real `jaxsmol serve` daemon on the bundled model: sync, async and streamed; a multi-turn
conversation and a long system prompt with `cache_control`; the same bits as /v1/chat/completions
(greedy, and seeded through the `seed` extension); usage's cache reads and creations; breakpoints that
expire on time (the daemon's TTLs scaled by $JAXSMOL_TEST_TTL_SCALE: "5m" is 6 s here); x-api-key
tenancy; and bad input answered in Anthropic's error shape, naming the field, never a 5xx.

Each test runs in a cache namespace of its own (`cache_salt`), so that what it reads is its own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import anthropic
import httpx
import pytest

from daemon import REQUEST_TIMEOUT_S, Server, assert_healthy
from daemon import client as openai_client
from jaxsmol.cli.server.messages import TTL_SCALE_ENV

pytestmark = pytest.mark.real

ROOT, OTHER = "key-root", "key-b"  # an admin key (it reads GET /v1/cache), and a tenant's
TTL_SCALE = 0.02  # "5m" is 6 s, "1h" 72 s
FIVE_MINUTES_S = 300 * TTL_SCALE
PINNED_BYTES = 40_000_000  # ~860 positions of the bundled model's float32 KV
SYSTEM = "You are a helpful geography tutor. Answer in one sentence."
LONG = "You are a careful assistant. Here is a list of facts to use. " + " ".join(
    f"Fact {i}: {i} times 7 is {7 * i}." for i in range(40))  # ~670 tokens
HUGE = " ".join(f"Entry {i}: the code word for {i} is w{i * 13 % 97}." for i in range(60))  # ~1000 tokens


@pytest.fixture(scope="module")
def url(tmp_path_factory, model_dir):  # model_dir: the bundled model imported once, unraced
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ROOT} - admin\n{OTHER}\n")
    with pytest.MonkeyPatch.context() as mp:  # the daemon's environment, not this process's afterwards
        mp.setenv(TTL_SCALE_ENV, str(TTL_SCALE))
        server = Server("--api-keys", str(keys), "--pinned-bytes", str(PINNED_BYTES))
    try:
        yield server.wait_ready().url
    finally:
        server.stop()


def sdk(url: str, key: str = ROOT) -> anthropic.Anthropic:
    # max_retries=0: no retry may hide an error
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S)


def salted(**extra) -> dict:
    """Greedy, in a fresh cache namespace (the SDK sends sampling settings as extra body fields)."""
    return {"temperature": 0, "cache_salt": uuid.uuid4().hex, **extra}


def chat(url: str, system: str, messages: list[dict], body: dict, max_tokens: int):
    """The same conversation through /v1/chat/completions (the same key, sampling and namespace)."""
    return openai_client(url, ROOT).chat.completions.create(
        model="m", max_tokens=max_tokens, messages=[{"role": "system", "content": system}] + messages,
        temperature=body["temperature"], seed=body.get("seed"), extra_body={"cache_salt": body["cache_salt"]})


def total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def tokenize(url: str, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered with no assistant's turn opened: what a breakpoint at their end keeps."""
    r = httpx.post(url + "/tokenize", headers={"x-api-key": ROOT}, timeout=REQUEST_TIMEOUT_S,
                   json={"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def namespace_pinned(url: str, salt: str) -> int:
    r = httpx.get(url + "/v1/cache?limit=1", headers={"x-api-key": ROOT}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return sum(n["pinned_bytes"] for n in r.json()["namespaces"] if n["cache_salt"] == salt)


# ---- conversations -------------------------------------------------------------------------------------
def test_a_conversation_equals_chat_completions_and_its_second_turn_reads_the_first(url):
    c, body = sdk(url), salted()
    turn1 = [{"role": "user", "content": "Name the capital city of France."}]
    first = c.messages.create(model="m", max_tokens=40, system=SYSTEM, messages=turn1, extra_body=body)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.model == "SmolLM2-135M-Instruct" and first.stop_reason == "end_turn" and first.stop_sequence is None
    [block] = first.content
    assert block.type == "text" and "Paris" in block.text
    u1 = first.usage
    assert (u1.cache_read_input_tokens, u1.cache_creation_input_tokens) == (0, 0)  # no breakpoint, a new namespace
    assert total(u1) == c.messages.count_tokens(model="m", system=SYSTEM, messages=turn1).input_tokens
    same = chat(url, SYSTEM, turn1, body, 40)
    assert same.choices[0].message.content == block.text and same.usage.prompt_tokens == total(u1)
    assert same.usage.completion_tokens == u1.output_tokens

    turn2 = turn1 + [{"role": "assistant", "content": [{"type": "text", "text": block.text}]},
                     {"role": "user", "content": "And of Italy?"}]
    second = c.messages.create(model="m", max_tokens=40, system=[{"type": "text", "text": SYSTEM}], messages=turn2,
                               extra_body=body)
    u2 = second.usage
    # the first turn's prompt and answer (its end-of-turn token included) were stored for this one
    assert u2.cache_read_input_tokens == total(u1) + u1.output_tokens
    assert total(u2) == c.messages.count_tokens(model="m", system=SYSTEM, messages=turn2).input_tokens
    assert chat(url, SYSTEM, turn2, body, 40).choices[0].message.content == second.content[0].text


def test_seeded_sampling_equals_chat_completions_with_the_same_seed(url):
    c, body = sdk(url), salted(temperature=0.9, top_p=0.95, seed=7)
    messages = [{"role": "user", "content": "Write a short line about the sea."}]
    got = c.messages.create(model="m", max_tokens=24, system=SYSTEM, messages=messages, extra_body=body)
    again = c.messages.create(model="m", max_tokens=24, system=SYSTEM, messages=messages, extra_body=body)
    assert again.content[0].text == got.content[0].text  # a seed repeats a sampling, cached or not
    want = openai_client(url, ROOT).chat.completions.create(
        model="m", max_tokens=24, messages=[{"role": "system", "content": SYSTEM}] + messages, temperature=0.9,
        top_p=0.95, seed=7, extra_body={"cache_salt": body["cache_salt"]})
    assert want.choices[0].message.content == got.content[0].text


def test_a_stream_sync_and_async_gives_the_message_in_anthropics_events(url):
    c, body = sdk(url), salted()
    kw = dict(model="m", max_tokens=12, system=SYSTEM, messages=[{"role": "user", "content": "Name a colour."}],
              extra_body=body)
    whole = c.messages.create(**kw)
    events = list(c.messages.create(stream=True, **kw))  # (the SDK passes no ping on)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    raw = httpx.post(url + "/v1/messages", headers={"x-api-key": ROOT}, timeout=REQUEST_TIMEOUT_S,
                     json={**kw.pop("extra_body"), **kw, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [f.split("\n") for f in raw.text.split("\n\n") if f]
    names = [f[0].removeprefix("event: ") for f in frames]
    assert names == ["message_start", "content_block_start", "ping"] + kinds[2:]
    assert all(json.loads(f[1].removeprefix("data: "))["type"] == name for f, name in zip(frames, names))
    kw["extra_body"] = body
    start, delta = events[0].message.usage, events[-2]
    assert total(start) == total(whole.usage) and start.cache_read_input_tokens == total(whole.usage)  # stored
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens
    with c.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens

    async def run_async():
        a = anthropic.AsyncAnthropic(base_url=url, api_key=ROOT, max_retries=0, timeout=REQUEST_TIMEOUT_S)
        got = await a.messages.create(**kw)
        async with a.messages.stream(**kw) as s:
            text = "".join([t async for t in s.text_stream])
        count = await a.messages.count_tokens(model="m", system=SYSTEM, messages=kw["messages"])
        return got, text, count

    got, text, count = asyncio.run(run_async())
    assert got.content[0].text == text == whole.content[0].text and count.input_tokens == total(whole.usage)


def test_stop_sequences_and_a_prefilled_answer(url):
    c, body = sdk(url), salted()
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    got = c.messages.create(model="m", max_tokens=40, system=SYSTEM, messages=messages,
                            stop_sequences=["never", "capital"], extra_body=body)
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", "capital") and "capital" not in got.content[0].text
    short = c.messages.create(model="m", max_tokens=2, system=SYSTEM, messages=messages, extra_body=body)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # a final assistant message is continued (Anthropic's prefill): the answer is what follows it
    prefilled = c.messages.create(model="m", max_tokens=10, system=SYSTEM, extra_body=body,
                                  messages=messages + [{"role": "assistant", "content": "The capital city is"}])
    prompt = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{messages[0]['content']}<|im_end|>\n"
              "<|im_start|>assistant\nThe capital city is")
    want = openai_client(url, ROOT).completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                                       extra_body={"cache_salt": body["cache_salt"]})
    assert prefilled.content[0].text == want.choices[0].text


# ---- cache_control ---------------------------------------------------------------------------------------
def _first_text(stream) -> float:
    started = time.perf_counter()
    with stream as s:
        next(iter(s.text_stream))
        elapsed = time.perf_counter() - started
        s.until_done()
    return elapsed


def test_a_long_system_prompts_breakpoint_is_kept_and_read_by_the_next_request(url):
    c, body = sdk(url), salted()
    system = [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "What is 6 times 7?"}]
    first = c.messages.create(model="m", max_tokens=8, system=system, messages=ask, extra_body=body)
    u = first.usage
    kept = len(tokenize(url, [{"role": "system", "content": LONG}]))  # the system turn
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == kept > 600
    assert u.input_tokens == total(u) - u.cache_creation_input_tokens
    assert total(u) == c.messages.count_tokens(model="m", system=system, messages=ask).input_tokens
    assert namespace_pinned(url, body["cache_salt"]) > 0
    # other questions on the same system prompt read it, and keep nothing new
    second = c.messages.create(model="m", max_tokens=8, system=system, extra_body=body,
                               messages=[{"role": "user", "content": "What is 9 times 7?"}])
    assert second.usage.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    # time to first token, cold (the breakpoint made) and warm (read), streamed
    cold_body = salted()
    cold = _first_text(c.messages.stream(model="m", max_tokens=4, system=system, messages=ask, extra_body=cold_body))
    warm = _first_text(c.messages.stream(model="m", max_tokens=4, system=system, extra_body=cold_body,
                                         messages=[{"role": "user", "content": "What is 3 times 7?"}]))
    print(f"\nlong system prompt ({u.cache_creation_input_tokens} tokens kept): time to first token "
          f"{cold * 1000:.0f} ms made, {warm * 1000:.0f} ms read ({cold / warm:.1f}x)")
    assert warm < cold


def test_cache_control_pins_expire_on_time_and_a_renewal_extends_them(url):
    c, body = sdk(url), salted()
    kw = dict(model="m", max_tokens=4, messages=[{"role": "user", "content": "Name a river."}], extra_body=body,
              system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
              cache_control={"type": "ephemeral"})  # the top level: the end of the last message, 5 minutes
    sent = time.monotonic()
    first = c.messages.create(**kw)
    answered = time.monotonic()
    both = namespace_pinned(url, body["cache_salt"])
    turns = [{"role": "system", "content": SYSTEM}] + kw["messages"]
    # kept: the conversation but the assistant's turn opened ("<|im_start|>assistant\n": 4 tokens)
    assert first.usage.cache_creation_input_tokens == len(tokenize(url, turns)) == total(first.usage) - 4
    assert both > 0
    time.sleep(max(0.0, sent + FIVE_MINUTES_S / 2 - time.monotonic()))
    renewed_at = time.monotonic()
    second = c.messages.create(**kw)  # the same breakpoints: renewed, nothing newly kept
    renewed_end = time.monotonic()
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    time.sleep(max(0.0, answered + FIVE_MINUTES_S + 0.5 - time.monotonic()))
    if time.monotonic() < renewed_at + FIVE_MINUTES_S - 0.3:  # (a slow machine may have passed it)
        assert namespace_pinned(url, body["cache_salt"]) == both  # the first expiry passed: renewed
    time.sleep(max(0.0, renewed_end + FIVE_MINUTES_S + 0.5 - time.monotonic()))
    system_only = namespace_pinned(url, body["cache_salt"])
    assert 0 < system_only < both  # the 5-minute pin expired, the 1-hour one stays
    r = httpx.request("DELETE", url + "/v1/cache/pin", headers={"x-api-key": ROOT}, timeout=REQUEST_TIMEOUT_S,
                      json={"prompt": tokenize(url, turns[:1]), "cache_salt": body["cache_salt"]})
    assert r.status_code == 200 and r.json()["unpinned"], r.text
    assert namespace_pinned(url, body["cache_salt"]) == 0


def test_a_breakpoint_past_pinned_bytes_is_left_out_and_the_request_served(url):
    c, body = sdk(url), salted()
    system = [{"type": "text", "text": HUGE, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "What is the code word for 3?"}]
    got = c.messages.create(model="m", max_tokens=6, system=system, messages=ask, extra_body=body)
    assert got.usage.cache_creation_input_tokens == 0 and got.usage.cache_read_input_tokens == 0
    assert got.usage.input_tokens == c.messages.count_tokens(model="m", system=system, messages=ask).input_tokens > 900
    assert got.content[0].text and namespace_pinned(url, body["cache_salt"]) == 0


# ---- keys ------------------------------------------------------------------------------------------------
def test_x_api_key_and_bearer_keys_and_each_keys_own_namespace(url):
    body = salted()
    kw = dict(model="m", max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": "Name a city."}],
              extra_body=body)
    sdk(url).messages.create(**kw)
    other = sdk(url, OTHER).messages.create(**kw)  # the same conversation, salt, another key: nothing read
    assert other.usage.cache_read_input_tokens == 0
    bearer = anthropic.Anthropic(base_url=url, auth_token=ROOT, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.create(**kw).usage.cache_read_input_tokens == total(other.usage)
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(url, "wrong").messages.create(**kw)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages/count_tokens", json={"messages": kw["messages"]}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 401 and r.json()["type"] == "error"


# ---- bad input -------------------------------------------------------------------------------------------
OK = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
BAD = [  # (body, the field the message names)
    ({k: v for k, v in OK.items() if k != "max_tokens"}, "max_tokens"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "messages": []}, "messages"),
    ({**OK, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({**OK, "temperature": 1.5}, "temperature"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages.0.content.0"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "messages.0.content.0"),
    ({**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                             "input": {}}]}]}, "messages.0.content.0"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages.0.content.0.type"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({**OK, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({**OK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({**OK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({**OK, "cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl"),
    ({**OK, "system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
     "system.0.cache_control"),
    ({**OK, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 4,
      "cache_control": {"type": "ephemeral"}}, "cache_control"),  # the 5th
    ({**OK, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({**OK, "max_tokens": 100_000}, "messages"),  # past the context
    ({**OK, "output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_bad_input_gets_anthropics_error_naming_the_field(url, body, field):
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": ROOT}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
    assert got["error"]["message"].startswith(field + ":"), got


def test_other_errors_in_anthropics_shape_and_the_daemon_unharmed(url):
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk(url).messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert "image" in e.value.body["error"]["message"]
    for method, path, content, status, kind in [
            ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
            ("POST", "/v1/messages/count_tokens", b"[1, 2]", 400, "invalid_request_error"),
            ("GET", "/v1/messages", b"", 405, "invalid_request_error"),
            ("POST", "/v1/messages/batches", b"{}", 404, "not_found_error")]:
        r = httpx.request(method, url + path, content=content, timeout=REQUEST_TIMEOUT_S,
                          headers={"x-api-key": ROOT, "content-type": "application/json"})
        assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (status, "error", kind), r.text
    assert_healthy(url)
    got = sdk(url).messages.create(**OK, extra_body=salted())
    assert got.content[0].text and got.stop_reason in ("end_turn", "max_tokens")
